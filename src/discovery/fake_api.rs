//! An in-process stand-in for the Kubernetes API server's list and watch, faithful where the
//! router's and the agent's clients depend on it (compiled only for tests, and for other
//! crates' tests with the `fake-kube-api` feature):
//! - one resourceVersion counter over every object, as etcd's revision;
//! - `GET <collection>` lists the objects that match `labelSelector` (`k=v`, `k==v`, `k!=v`,
//!   `k`, `!k`, comma-joined) and `fieldSelector` (`path=v`, `path==v`, `path!=v` on dotted
//!   paths such as `metadata.name` or `spec.nodeName`, comma-joined), with the collection's
//!   resourceVersion;
//! - `GET <collection>?watch=true&resourceVersion=RV` streams, as chunked JSON lines, every
//!   change after RV and then changes as they happen. An object that stops matching the
//!   selector is sent as DELETED, one that starts matching as ADDED, as the API server does.
//!   Each event is written in two chunks, so the client must reassemble lines;
//! - a watch from a resourceVersion older than the last [`FakeApi::compact`] gets the API
//!   server's `ERROR` event with a 410 Gone Status (watches already open still get every
//!   change, as the API server's do), and a list or watch while [`FakeApi::set_broken`] is on
//!   gets 500;
//! - [`FakeApi::bookmark`] sends BOOKMARK events to watches that allowed them, and
//!   [`FakeApi::drop_watches`] ends every open watch stream (as an API server restart does).
//!
//! A collection is named by its URL path, e.g. `/api/v1/namespaces/llm/pods`.

#![allow(
    clippy::expect_used,
    reason = "test support: a broken fake is a failed test"
)]

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::watch;

/// One change in the log: the object after it (`object`), and before it (`previous`).
#[derive(Clone)]
struct Change {
    revision: u64,
    collection: String,
    kind: &'static str,
    object: Value,
    previous: Option<Value>,
}

#[derive(Default)]
struct Store {
    revision: u64,
    /// (collection, name) → object.
    objects: BTreeMap<(String, String), Value>,
    log: Vec<Change>,
    /// Watches from a revision below this get 410 Gone.
    compacted: u64,
    broken: bool,
    /// Bumped to end every open watch.
    watch_epoch: u64,
    /// Bumped by each bookmark request.
    bookmarks: u64,
    /// Every request's path and query, in order.
    requests: Vec<String>,
    /// The collection of each BOOKMARK sent.
    bookmarks_sent: Vec<String>,
}

/// The fake API server's state; cheap to clone into tests.
#[derive(Clone)]
pub struct FakeApi {
    store: Arc<Mutex<Store>>,
    /// Wakes open watches after a change, a bookmark request or a drop.
    changed: Arc<watch::Sender<()>>,
}

impl FakeApi {
    /// Starts serving on a free loopback port; returns the API and a client for it.
    pub async fn start() -> (FakeApi, SocketAddr) {
        let api = FakeApi {
            store: Arc::default(),
            changed: Arc::new(watch::Sender::new(())),
        };
        let app = axum::Router::new()
            .fallback(axum::routing::get(handle))
            .with_state(api.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        (api, addr)
    }

    /// A kube client for the server at `addr`.
    pub fn client(addr: SocketAddr) -> kube::Client {
        let uri = format!("http://{addr}").parse().expect("a loopback URI");
        kube::Client::try_from(kube::Config::new(uri)).expect("a client")
    }

    /// Writes a kubeconfig for the server at `addr` (namespace `llm`) into `dir`; returns its
    /// path.
    pub fn kubeconfig(addr: SocketAddr, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters: [{{name: fake, cluster: {{server: 'http://{addr}'}}}}]\n\
             users: [{{name: test, user: {{token: t}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: test, namespace: llm}}}}]\n"
        );
        std::fs::write(&path, text).expect("write the kubeconfig");
        path
    }

    /// Creates or replaces `object` (named by its `metadata.name`) in `collection`.
    pub fn apply(&self, collection: &str, mut object: Value) {
        let name = object["metadata"]["name"]
            .as_str()
            .expect("an object with metadata.name")
            .to_string();
        let mut store = self.store.lock();
        store.revision += 1;
        let revision = store.revision;
        object["metadata"]["resourceVersion"] = json!(revision.to_string());
        let key = (collection.to_string(), name);
        let previous = store.objects.insert(key, object.clone());
        let kind = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        store.log.push(Change {
            revision,
            collection: collection.to_string(),
            kind,
            object,
            previous,
        });
        drop(store);
        self.changed.send_replace(());
    }

    /// Deletes the object `name` from `collection`, if there.
    pub fn delete(&self, collection: &str, name: &str) {
        let mut store = self.store.lock();
        let Some(mut object) = store
            .objects
            .remove(&(collection.to_string(), name.to_string()))
        else {
            return;
        };
        store.revision += 1;
        let revision = store.revision;
        let previous = Some(object.clone());
        object["metadata"]["resourceVersion"] = json!(revision.to_string());
        store.log.push(Change {
            revision,
            collection: collection.to_string(),
            kind: "DELETED",
            object,
            previous,
        });
        drop(store);
        self.changed.send_replace(());
    }

    /// Forgets the history: a new watch from any revision before the current one gets 410
    /// Gone. The log itself stays, because watches already open must still send the changes
    /// they have not read yet (an API server's open watches lose nothing to compaction).
    pub fn compact(&self) {
        let mut store = self.store.lock();
        store.compacted = store.revision;
    }

    /// While on, every request is answered 500.
    pub fn set_broken(&self, broken: bool) {
        self.store.lock().broken = broken;
    }

    /// Ends every open watch stream.
    pub fn drop_watches(&self) {
        self.store.lock().watch_epoch += 1;
        self.changed.send_replace(());
    }

    /// Sends a BOOKMARK at the current revision to every watch that allowed bookmarks.
    pub fn bookmark(&self) {
        self.store.lock().bookmarks += 1;
        self.changed.send_replace(());
    }

    /// How many BOOKMARK events were written to watches of `collection`. Once written, the
    /// client reads it before anything that ends the stream.
    pub fn bookmarks_sent(&self, collection: &str) -> usize {
        let store = self.store.lock();
        store
            .bookmarks_sent
            .iter()
            .filter(|c| *c == collection)
            .count()
    }

    /// How many requests so far were lists (`watch` false) and how many watches, for `path`.
    pub fn requests(&self, path: &str) -> (usize, usize) {
        let store = self.store.lock();
        let of_path = store.requests.iter().filter(|r| r.starts_with(path));
        let (watches, lists): (Vec<_>, Vec<_>) = of_path.partition(|r| r.contains("watch=true"));
        (lists.len(), watches.len())
    }
}

/// A label or field selector: every term must hold.
struct Selector {
    labels: Vec<(String, LabelTest)>,
    /// Dotted paths into the object (`spec.nodeName`) and what they must be.
    fields: Vec<(String, LabelTest)>,
}

enum LabelTest {
    Equals(String),
    NotEquals(String),
    Exists,
    Absent,
}

impl LabelTest {
    fn holds(&self, value: Option<&str>) -> bool {
        match self {
            LabelTest::Equals(want) => value == Some(want),
            LabelTest::NotEquals(want) => value != Some(want),
            LabelTest::Exists => value.is_some(),
            LabelTest::Absent => value.is_none(),
        }
    }
}

impl Selector {
    fn parse(query: &HashMap<String, String>) -> Result<Selector, String> {
        let mut labels = Vec::new();
        for term in query
            .get("labelSelector")
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let test = if let Some((key, value)) = term.split_once("!=") {
                (key, LabelTest::NotEquals(value.to_string()))
            } else if let Some((key, value)) = term.split_once("==") {
                (key, LabelTest::Equals(value.to_string()))
            } else if let Some((key, value)) = term.split_once('=') {
                (key, LabelTest::Equals(value.to_string()))
            } else if let Some(key) = term.strip_prefix('!') {
                (key, LabelTest::Absent)
            } else if term.contains([' ', '(']) {
                return Err(format!("the fake does not parse set selectors: {term:?}"));
            } else {
                (term, LabelTest::Exists)
            };
            labels.push((test.0.to_string(), test.1));
        }
        let mut fields = Vec::new();
        for term in query
            .get("fieldSelector")
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            // As the API server: field selectors are equalities only.
            let (path, test) = if let Some((path, value)) = term.split_once("!=") {
                (path, LabelTest::NotEquals(value.to_string()))
            } else if let Some((path, value)) = term.split_once("==") {
                (path, LabelTest::Equals(value.to_string()))
            } else if let Some((path, value)) = term.split_once('=') {
                (path, LabelTest::Equals(value.to_string()))
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            fields.push((path.to_string(), test));
        }
        Ok(Selector { labels, fields })
    }

    fn matches(&self, object: &Value) -> bool {
        let metadata = &object["metadata"];
        let labels_hold = self
            .labels
            .iter()
            .all(|(key, test)| test.holds(metadata["labels"][key].as_str()));
        let fields_hold = self.fields.iter().all(|(path, test)| {
            let value = path.split('.').try_fold(object, |v, step| v.get(step));
            // An absent field reads as "", as the API server's field sets do.
            test.holds(Some(value.and_then(Value::as_str).unwrap_or("")))
        });
        labels_hold && fields_hold
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

/// What every request gets while [`FakeApi::set_broken`] is on.
fn broken_answer() -> Response {
    let body = status(500, "InternalError", "etcdserver: request timed out");
    (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(body)).into_response()
}

async fn handle(
    State(api): State<FakeApi>,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let collection = uri.path().to_string();
    {
        let mut store = api.store.lock();
        store.requests.push(
            uri.path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
        );
        if store.broken {
            return broken_answer();
        }
    }
    let selector = match Selector::parse(&query) {
        Ok(selector) => selector,
        Err(message) => {
            let body = status(400, "BadRequest", &message);
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if watching {
        let from = query
            .get("resourceVersion")
            .and_then(|rv| rv.parse::<u64>().ok())
            .unwrap_or(0);
        let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
        return watch_response(api, collection, selector, from, bookmarks);
    }
    let store = api.store.lock();
    let items: Vec<&Value> = store
        .objects
        .iter()
        .filter(|((c, _), object)| *c == collection && selector.matches(object))
        .map(|(_, object)| object)
        .collect();
    axum::Json(json!({
        "apiVersion": "v1",
        "kind": "List",
        "metadata": {"resourceVersion": store.revision.to_string()},
        "items": items,
    }))
    .into_response()
}

/// The events of `change` a watch with `selector` sees: what it was and is, as the API server
/// filters them.
fn event_for(change: &Change, selector: &Selector) -> Option<Value> {
    let was = change
        .previous
        .as_ref()
        .is_some_and(|p| selector.matches(p));
    let is = change.kind != "DELETED" && selector.matches(&change.object);
    let kind = match (was, is) {
        (false, true) => "ADDED",
        (true, true) => "MODIFIED",
        (true, false) => "DELETED",
        (false, false) => return None,
    };
    Some(json!({"type": kind, "object": change.object}))
}

fn watch_response(
    api: FakeApi,
    collection: String,
    selector: Selector,
    from: u64,
    bookmarks: bool,
) -> Response {
    let (epoch, first_bookmark, too_old) = {
        let store = api.store.lock();
        // Checked again under the lock that reads the epoch, so that a watch which passed the
        // first check cannot outlive a `set_broken` and `drop_watches` made meanwhile.
        if store.broken {
            return broken_answer();
        }
        (store.watch_epoch, store.bookmarks, from < store.compacted)
    };
    let mut changed = api.changed.subscribe();
    let stream = async_stream(move |mut out: Sender| async move {
        if too_old {
            let gone = status(410, "Expired", &format!("too old resource version: {from}"));
            out.event(json!({"type": "ERROR", "object": gone})).await;
            return;
        }
        let mut sent_up_to = from;
        let mut bookmarks_seen = first_bookmark;
        loop {
            let (events, ended) = {
                let store = api.store.lock();
                let mut events: Vec<Value> = store
                    .log
                    .iter()
                    .filter(|c| c.revision > sent_up_to && c.collection == collection)
                    .filter_map(|c| event_for(c, &selector))
                    .collect();
                sent_up_to = sent_up_to.max(store.revision);
                if bookmarks && store.bookmarks != bookmarks_seen {
                    events.push(json!({"type": "BOOKMARK", "object": {
                        "kind": "Bookmark", "apiVersion": "v1",
                        "metadata": {"resourceVersion": store.revision.to_string()},
                    }}));
                }
                bookmarks_seen = store.bookmarks;
                (events, store.watch_epoch != epoch)
            };
            if ended {
                return;
            }
            for event in events {
                let bookmark = event["type"] == "BOOKMARK";
                if !out.event(event).await {
                    return;
                }
                if bookmark {
                    let mut store = api.store.lock();
                    store.bookmarks_sent.push(collection.clone());
                }
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Writes watch events as JSON lines, each in two chunks.
struct Sender(tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>);

impl Sender {
    /// Whether the client is still reading.
    async fn event(&mut self, event: Value) -> bool {
        let mut line = event.to_string().into_bytes();
        line.push(b'\n');
        let second = line.split_off(line.len() / 2);
        self.0.send(Ok(Bytes::from(line))).await.is_ok()
            && self.0.send(Ok(Bytes::from(second))).await.is_ok()
    }
}

/// A body stream fed by `produce`, which runs until it returns or the client goes away.
fn async_stream<F>(
    produce: impl FnOnce(Sender) -> F,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, Infallible>>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(produce(Sender(tx)));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
