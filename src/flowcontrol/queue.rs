//! One model's waiting requests: priority bands, highest first; within a band one FIFO per
//! tenant (fairness id), taken round robin, so a tenant's burst waits behind its own requests
//! and not in front of everyone else's.
//!
//! A plain data structure, without time or locks; [`super::FlowControl`] owns one per model
//! behind its mutex.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// A queued request and where it belongs.
#[derive(Debug)]
pub(super) struct Waiting<T> {
    pub id: u64,
    pub priority: i32,
    pub tenant: Arc<str>,
    pub item: T,
}

/// What [`ModelQueue::push`] did with a request.
#[derive(Debug)]
pub(super) enum Pushed<T> {
    Queued,
    /// Queued in place of this one: the newest request of the busiest tenant in the lowest
    /// band, which was of lower priority.
    Displaced(Waiting<T>),
    /// Not queued: the queue is full of requests of its priority or higher.
    Refused(Waiting<T>),
}

#[derive(Debug)]
struct Band<T> {
    /// Tenants with waiting requests, the next to be served first.
    turn: VecDeque<Arc<str>>,
    tenants: HashMap<Arc<str>, VecDeque<Waiting<T>>>,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            turn: VecDeque::new(),
            tenants: HashMap::new(),
        }
    }
}

impl<T> Band<T> {
    fn push(&mut self, waiting: Waiting<T>, front: bool) {
        let queue = self.tenants.entry(Arc::clone(&waiting.tenant)).or_default();
        if queue.is_empty() {
            if front {
                self.turn.push_front(Arc::clone(&waiting.tenant));
            } else {
                self.turn.push_back(Arc::clone(&waiting.tenant));
            }
        }
        if front {
            queue.push_front(waiting);
        } else {
            queue.push_back(waiting);
        }
    }

    /// The next tenant's oldest request; the tenant goes to the back of the turn.
    fn pop(&mut self) -> Option<Waiting<T>> {
        let tenant = self.turn.pop_front()?;
        let queue = self.tenants.get_mut(&tenant)?;
        let waiting = queue.pop_front();
        if queue.is_empty() {
            self.tenants.remove(&tenant);
        } else {
            self.turn.push_back(tenant);
        }
        waiting
    }

    fn remove(&mut self, id: u64, tenant: &str) -> Option<Waiting<T>> {
        let queue = self.tenants.get_mut(tenant)?;
        let at = queue.iter().position(|w| w.id == id)?;
        let waiting = queue.remove(at);
        if queue.is_empty() {
            self.tenants.remove(tenant);
            self.turn.retain(|t| &**t != tenant);
        }
        waiting
    }

    /// The newest request of the tenant with the most waiting.
    fn remove_newest_of_busiest(&mut self) -> Option<Waiting<T>> {
        let (tenant, queue) = self.tenants.iter().max_by_key(|(_, q)| q.len())?;
        let (tenant, id) = (Arc::clone(tenant), queue.back()?.id);
        self.remove(id, &tenant)
    }

    fn is_empty(&self) -> bool {
        self.turn.is_empty()
    }
}

/// The queue of one model.
#[derive(Debug)]
pub(super) struct ModelQueue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    len: usize,
}

impl<T> Default for ModelQueue<T> {
    fn default() -> Self {
        ModelQueue {
            bands: BTreeMap::new(),
            len: 0,
        }
    }
}

impl<T> ModelQueue<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues `waiting` at the back of its tenant's FIFO when fewer than `bound` wait; when
    /// `bound` are waiting, in place of the lowest band's newest request if that band's
    /// priority is lower, else not at all.
    pub fn push(&mut self, waiting: Waiting<T>, bound: usize) -> Pushed<T> {
        if self.len < bound {
            self.insert(waiting, false);
            return Pushed::Queued;
        }
        let lowest = self.bands.keys().next_back().map(|Reverse(p)| *p);
        match lowest {
            Some(lowest) if lowest < waiting.priority => {
                let Some(displaced) = self.take_from(lowest, Band::remove_newest_of_busiest) else {
                    return Pushed::Refused(waiting);
                };
                self.insert(waiting, false);
                Pushed::Displaced(displaced)
            }
            _ => Pushed::Refused(waiting),
        }
    }

    /// Puts `waiting` back first in its tenant's FIFO and first in its band's turn, whatever
    /// the bound: it was dispatched, and lost its replica to a concurrent decision.
    pub fn push_front(&mut self, waiting: Waiting<T>) {
        self.insert(waiting, true);
    }

    /// The next request: the highest band's next tenant's oldest.
    pub fn pop(&mut self) -> Option<Waiting<T>> {
        let highest = self.bands.keys().next().map(|Reverse(p)| *p)?;
        self.take_from(highest, Band::pop)
    }

    /// Takes request `id` out (it expired or its client left); `None` if it is not queued.
    pub fn remove(&mut self, id: u64, priority: i32, tenant: &str) -> Option<Waiting<T>> {
        self.take_from(priority, |band| band.remove(id, tenant))
    }

    fn insert(&mut self, waiting: Waiting<T>, front: bool) {
        self.bands
            .entry(Reverse(waiting.priority))
            .or_default()
            .push(waiting, front);
        self.len += 1;
    }

    fn take_from(
        &mut self,
        priority: i32,
        take: impl FnOnce(&mut Band<T>) -> Option<Waiting<T>>,
    ) -> Option<Waiting<T>> {
        let band = self.bands.get_mut(&Reverse(priority))?;
        let taken = take(band);
        if band.is_empty() {
            self.bands.remove(&Reverse(priority));
        }
        if taken.is_some() {
            self.len -= 1;
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn waiting(id: u64, priority: i32, tenant: &str) -> Waiting<()> {
        Waiting {
            id,
            priority,
            tenant: Arc::from(tenant),
            item: (),
        }
    }

    fn drain(queue: &mut ModelQueue<()>) -> Vec<u64> {
        std::iter::from_fn(|| queue.pop()).map(|w| w.id).collect()
    }

    #[test]
    fn higher_priorities_go_first_and_tenants_take_turns() {
        let mut queue = ModelQueue::default();
        // A noisy tenant queues five before a quiet one queues two.
        for id in 1..=5 {
            queue.push(waiting(id, 0, "noisy"), 100);
        }
        queue.push(waiting(6, 0, "quiet"), 100);
        queue.push(waiting(7, 0, "quiet"), 100);
        queue.push(waiting(8, -1, "batch"), 100);
        queue.push(waiting(9, 10, "noisy"), 100);
        assert_eq!(queue.len(), 9);
        assert_eq!(drain(&mut queue), [9, 1, 6, 2, 7, 3, 4, 5, 8]);
        assert!(queue.is_empty());
    }

    #[test]
    fn a_full_queue_displaces_the_lowest_band_s_busiest_tenant_s_newest() {
        let mut queue = ModelQueue::default();
        queue.push(waiting(1, -1, "a"), 4);
        queue.push(waiting(2, -1, "b"), 4);
        queue.push(waiting(3, -1, "b"), 4);
        queue.push(waiting(4, 0, "a"), 4);
        // Same priority as the lowest waiting: refused.
        let Pushed::Refused(refused) = queue.push(waiting(5, -1, "c"), 4) else {
            panic!("a full queue took a request of the lowest priority");
        };
        assert_eq!(refused.id, 5);
        let Pushed::Displaced(displaced) = queue.push(waiting(6, 0, "c"), 4) else {
            panic!("a higher priority did not displace a lower one");
        };
        assert_eq!(displaced.id, 3);
        assert_eq!(queue.len(), 4);
        assert_eq!(drain(&mut queue), [4, 6, 1, 2]);
    }

    #[test]
    fn removed_and_requeued_requests_keep_the_order() {
        let mut queue = ModelQueue::default();
        for (id, tenant) in [(1, "a"), (2, "a"), (3, "b")] {
            queue.push(waiting(id, 0, tenant), 10);
        }
        assert!(queue.remove(2, 0, "a").is_some());
        assert!(queue.remove(2, 0, "a").is_none());
        assert!(queue.remove(3, 5, "b").is_none(), "wrong band");
        let first = queue.pop().expect("one queued");
        assert_eq!(first.id, 1);
        // It lost its replica to a race: back in front, ahead of tenant b.
        queue.push_front(first);
        assert_eq!(drain(&mut queue), [1, 3]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push { priority: i32, tenant: u8 },
        Pop,
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (-2i32..3, 0u8..4).prop_map(|(priority, tenant)| Op::Push { priority, tenant }),
            Just(Op::Pop),
            (0usize..64).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Against a model that keeps every request in a list: the length never passes the
        /// bound, each pop is of the highest waiting priority and the oldest of its tenant,
        /// and a request is answered (popped, removed, displaced or refused) exactly once.
        #[test]
        fn agrees_with_a_list(ops in proptest::collection::vec(op(), 1..200), bound in 1usize..8) {
            let mut queue = ModelQueue::default();
            let mut model: Vec<(u64, i32, String)> = Vec::new();
            let mut next = 0u64;
            let mut answered = std::collections::HashSet::new();
            for op in ops {
                match op {
                    Op::Push { priority, tenant } => {
                        next += 1;
                        let tenant = format!("t{tenant}");
                        match queue.push(waiting(next, priority, &tenant), bound) {
                            Pushed::Queued => model.push((next, priority, tenant)),
                            Pushed::Displaced(d) => {
                                prop_assert!(d.priority < priority);
                                prop_assert!(model.iter().all(|m| m.1 >= d.priority));
                                model.retain(|m| m.0 != d.id);
                                prop_assert!(answered.insert(d.id));
                                model.push((next, priority, tenant));
                            }
                            Pushed::Refused(r) => {
                                prop_assert_eq!(model.len(), bound);
                                prop_assert!(model.iter().all(|m| m.1 >= priority));
                                prop_assert!(answered.insert(r.id));
                            }
                        }
                    }
                    Op::Pop => match queue.pop() {
                        Some(w) => {
                            let top = model.iter().map(|m| m.1).max();
                            prop_assert_eq!(Some(w.priority), top);
                            let oldest = model
                                .iter()
                                .find(|m| m.1 == w.priority && *m.2 == *w.tenant)
                                .map(|m| m.0);
                            prop_assert_eq!(Some(w.id), oldest);
                            model.retain(|m| m.0 != w.id);
                            prop_assert!(answered.insert(w.id));
                        }
                        None => prop_assert!(model.is_empty()),
                    },
                    Op::Remove(i) => {
                        if let Some((id, priority, tenant)) = model.get(i % model.len().max(1)).cloned() {
                            prop_assert!(queue.remove(id, priority, &tenant).is_some());
                            model.retain(|m| m.0 != id);
                            prop_assert!(answered.insert(id));
                        }
                    }
                }
                prop_assert_eq!(queue.len(), model.len());
                prop_assert!(queue.len() <= bound);
            }
        }
    }
}
