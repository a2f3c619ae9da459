//! Sequence-number bookkeeping for one engine's stream (pure; owned by the intake task).

/// What a received sequence number means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next one expected (or the first one seen).
    InOrder,
    /// Batches `from..seq` are missing.
    Gap { from: u64 },
    /// Already applied (a live message that a replay carried first).
    Duplicate,
    /// Below anything that could be a duplicate: the publisher restarted from 0.
    Restart { expected: u64 },
}

/// Tracks the next expected seq and the range that may legitimately repeat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqTracker {
    expected: Option<u64>,
    /// Seqs in `dup_floor..expected` are duplicates; lower ones mean a restart.
    dup_floor: u64,
}

impl SeqTracker {
    /// A tracker that expects `seq` next, with nothing before it applied (a new engine life
    /// counts from 0).
    pub fn expecting(seq: u64) -> Self {
        SeqTracker {
            expected: Some(seq),
            dup_floor: seq,
        }
    }

    pub fn expected(&self) -> Option<u64> {
        self.expected
    }

    pub fn observe(&self, seq: u64) -> SeqVerdict {
        match self.expected {
            None => SeqVerdict::InOrder,
            Some(e) if seq == e => SeqVerdict::InOrder,
            Some(e) if seq > e => SeqVerdict::Gap { from: e },
            Some(_) if seq >= self.dup_floor => SeqVerdict::Duplicate,
            Some(e) => SeqVerdict::Restart { expected: e },
        }
    }

    /// `seq` was applied in order.
    pub fn applied(&mut self, seq: u64) {
        let next = seq.saturating_add(1);
        self.expected = Some(next);
        self.dup_floor = next;
    }

    /// Continue after `seq` whatever came before (after a reset).
    pub fn restart_at(&mut self, seq: u64) {
        self.applied(seq);
    }

    /// Live messages from `seq` up to the expected one may still arrive (they were queued
    /// while a replay delivered them); they are duplicates, not a restart.
    pub fn allow_duplicates_from(&mut self, seq: u64) {
        if let Some(e) = self.expected {
            self.dup_floor = seq.min(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gap_duplicate_and_restart() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(5), SeqVerdict::InOrder, "first seen is accepted");
        t.applied(5);
        assert_eq!(t.observe(6), SeqVerdict::InOrder);
        assert_eq!(t.observe(9), SeqVerdict::Gap { from: 6 });
        assert_eq!(t.observe(5), SeqVerdict::Restart { expected: 6 });
        // A replay filled 6..=12 after live 9 revealed the gap.
        for s in 6..=12 {
            assert_eq!(t.observe(s), SeqVerdict::InOrder);
            t.applied(s);
        }
        t.allow_duplicates_from(9);
        assert_eq!(t.observe(10), SeqVerdict::Duplicate, "queued live copy");
        assert_eq!(t.observe(8), SeqVerdict::Restart { expected: 13 });
        assert_eq!(t.observe(0), SeqVerdict::Restart { expected: 13 });
        assert_eq!(t.observe(13), SeqVerdict::InOrder);
        t.applied(13);
        assert_eq!(t.observe(12), SeqVerdict::Restart { expected: 14 });
        t.applied(u64::MAX);
        assert_eq!(t.expected(), Some(u64::MAX));
    }

    #[test]
    fn a_new_life_expects_zero_so_a_later_first_seq_is_a_gap_from_zero() {
        let t = SeqTracker::expecting(0);
        assert_eq!(t.observe(0), SeqVerdict::InOrder);
        assert_eq!(t.observe(3), SeqVerdict::Gap { from: 0 });
    }
}
