//! Loopback ports for test processes that take a fixed port in their configuration (Envoy, an
//! agent's admin server), test-only.
//!
//! A port the kernel picked for `bind(0)` and released is back in the ephemeral range, where any
//! outgoing connection on the machine may take it before the process it was meant for binds it;
//! CI saw Envoy fail with "Address already in use" that way. These ports come from below the
//! ephemeral range instead (Linux's starts at 32768), which only other callers of this function
//! use: each process starts at its own offset (from its pid) and walks on from there, skipping
//! any port that is bound now.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The range handed out: above the registered services most machines run, below the ephemeral
/// range.
const FIRST: u32 = 20_000;
const END: u32 = 32_768;

/// A loopback port that nothing had bound at the time of the call and that the kernel does not
/// hand out for `bind(0)` or outgoing connections.
pub fn loopback_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = END - FIRST;
    // Spread processes apart: a multiplicative hash of the pid picks each one's starting point.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    let candidates =
        (0..span).map(|_| FIRST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span);
    first_unbound(candidates).unwrap_or_else(|| panic!("no free loopback port in {FIRST}..{END}"))
}

/// The first candidate no socket has bound on 127.0.0.1.
fn first_unbound(candidates: impl Iterator<Item = u32>) -> Option<u16> {
    candidates
        .filter_map(|port| u16::try_from(port).ok())
        .find(|&port| TcpListener::bind(("127.0.0.1", port)).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..64).map(|_| loopback_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
        for port in ports {
            assert!(
                (FIRST..END).contains(&u32::from(port)),
                "{port} out of range"
            );
            TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }

    #[test]
    fn a_bound_port_is_skipped() {
        let held = loopback_port();
        let _listener = TcpListener::bind(("127.0.0.1", held)).expect("bind");
        let next = loopback_port();
        let candidates = [u32::from(held), u32::from(next)];
        assert_eq!(first_unbound(candidates.into_iter()), Some(next));
        assert_eq!(first_unbound([u32::from(held)].into_iter()), None);
    }
}
