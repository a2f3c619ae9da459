//! The names llmgw passes between processes, as types, so that a replica's address is never
//! handed where a node's name is expected. Each is a cheap-to-clone shared string.

use std::fmt;
use std::sync::Arc;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(pub Arc<str>);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(name: &str) -> Self {
                $name(Arc::from(name))
            }
        }

        impl From<String> for $name {
            fn from(name: String) -> Self {
                $name(Arc::from(name))
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

name_type!(
    /// The `host:port` the routers know a replica by (the address Envoy sends its requests to).
    ReplicaId
);
name_type!(
    /// A Kubernetes node (or any host) that one agent speaks for.
    NodeName
);
name_type!(
    /// A model as requests name it (`model` in an OpenAI body), empty when not configured.
    ModelName
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_prints_and_compares_as_its_text() {
        let replica = ReplicaId::from("10.0.0.7:8000");
        assert_eq!(replica.to_string(), "10.0.0.7:8000");
        assert_eq!(replica, ReplicaId::from(String::from("10.0.0.7:8000")));
        assert_ne!(replica.as_str(), NodeName::from("node-a").as_str());
        assert!(ModelName::default().as_str().is_empty());
    }
}
