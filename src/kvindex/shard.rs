//! One shard of the block map, laid out for memory: a block held by one replica (the common
//! case) costs one 12-byte bucket (4-byte-aligned key, packed holder) plus hashbrown's control
//! byte; a block held by several moves its holders to a side map, leaving a marker behind.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use super::{Medium, ReplicaSlot};
use crate::blockhash::ExternalHash;

type State = foldhash::fast::RandomState;

/// A block hash split in two `u32`s, so the key has 4-byte alignment and a bucket is 12 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key([u32; 2]);

impl Key {
    fn new(hash: ExternalHash) -> Key {
        Key([(hash.0 >> 32) as u32, hash.0 as u32])
    }

    fn block(self) -> ExternalHash {
        ExternalHash((u64::from(self.0[0]) << 32) | u64::from(self.0[1]))
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.block().0);
    }
}

/// One replica's hold on one block, packed in 32 bits: slot (16) | GPU references (4) |
/// offloaded references (4) | epoch of the latest store (8). Reference counts saturate at 15:
/// vLLM reports a block stored again only while an earlier copy is still cached, rarely more
/// than twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder(u32);

/// The slot value that marks "holders in the side map".
const MANY: u16 = u16::MAX;

/// The first slot the index cannot give out.
pub(super) const MAX_SLOTS: usize = MANY as usize;

impl Holder {
    fn new(slot: ReplicaSlot, medium: Medium, epoch: u8) -> Holder {
        Holder((u32::from(slot.0) << 16) | u32::from(epoch)).with_refs(medium, 1)
    }

    fn many_marker() -> Holder {
        Holder(u32::from(MANY) << 16)
    }

    pub(super) fn slot(self) -> ReplicaSlot {
        ReplicaSlot((self.0 >> 16) as u16)
    }

    fn is_marker(self) -> bool {
        self.slot().0 == MANY
    }

    fn shift(medium: Medium) -> u32 {
        match medium {
            Medium::Gpu => 12,
            Medium::Offloaded => 8,
        }
    }

    fn refs(self, medium: Medium) -> u8 {
        ((self.0 >> Self::shift(medium)) & 0xf) as u8
    }

    fn with_refs(self, medium: Medium, refs: u8) -> Holder {
        let shift = Self::shift(medium);
        Holder((self.0 & !(0xf << shift)) | (u32::from(refs.min(15)) << shift))
    }

    pub(super) fn on_gpu(self) -> bool {
        self.refs(Medium::Gpu) > 0
    }

    fn is_empty(self) -> bool {
        self.refs(Medium::Gpu) == 0 && self.refs(Medium::Offloaded) == 0
    }

    pub(super) fn epoch(self) -> u8 {
        self.0 as u8
    }

    fn with_epoch(self, epoch: u8) -> Holder {
        Holder((self.0 & !0xff) | u32::from(epoch))
    }
}

/// Bit of a slot in the 64-bit holder masks; slots from 64 on have none (lookups over them
/// take the general path).
pub(super) fn slot_bit(slot: ReplicaSlot) -> u64 {
    if slot.0 < 64 { 1 << slot.0 } else { 0 }
}

/// Many holders of one block, with masks of the first 64 slots so that a lookup over up to 64
/// replicas intersects candidate sets in one instruction per block however many hold it.
#[derive(Debug, Clone)]
struct ManyHolders {
    /// Slots holding the block on any tier.
    any: u64,
    /// Slots holding it in GPU memory.
    gpu: u64,
    list: Vec<Holder>,
}

/// Most holders kept inline in a shared entry.
const FEW: usize = 3;

/// The holders of a block held by two or more replicas: up to [`FEW`] inline (16 bytes, no
/// allocation: the common case of a prompt cached on two or three replicas), more boxed.
#[derive(Debug, Clone)]
enum Shared {
    Few { len: u8, list: [Holder; FEW] },
    Lots(Box<ManyHolders>),
}

fn masks_of(list: &[Holder]) -> (u64, u64) {
    list.iter().fold((0, 0), |(any, gpu), h| {
        let bit = slot_bit(h.slot());
        (any | bit, if h.on_gpu() { gpu | bit } else { gpu })
    })
}

impl Shared {
    fn from_list(list: Vec<Holder>) -> Shared {
        if list.len() <= FEW {
            let mut few = [Holder(0); FEW];
            few[..list.len()].copy_from_slice(&list);
            Shared::Few {
                len: list.len() as u8,
                list: few,
            }
        } else {
            let (any, gpu) = masks_of(&list);
            Shared::Lots(Box::new(ManyHolders { any, gpu, list }))
        }
    }

    fn list(&self) -> &[Holder] {
        match self {
            Shared::Few { len, list } => &list[..usize::from(*len)],
            Shared::Lots(many) => &many.list,
        }
    }

    fn masks(&self) -> (u64, u64) {
        match self {
            Shared::Few { .. } => masks_of(self.list()),
            Shared::Lots(many) => (many.any, many.gpu),
        }
    }

    /// Applies `change` to the holder list; shapes the entry anew for its new length.
    fn change<R>(&mut self, change: impl FnOnce(&mut Vec<Holder>) -> R) -> R {
        match self {
            Shared::Lots(many) if many.list.len() > FEW + 1 => {
                // Stays large: change in place, no reallocation.
                let result = change(&mut many.list);
                let (any, gpu) = masks_of(&many.list);
                many.any = any;
                many.gpu = gpu;
                if many.list.len() <= FEW {
                    *self = Shared::from_list(std::mem::take(&mut many.list));
                }
                result
            }
            _ => {
                let mut list = self.list().to_vec();
                let result = change(&mut list);
                *self = Shared::from_list(list);
                result
            }
        }
    }
}

/// The holders of one block, as a lookup sees them.
pub(super) enum HoldersRef<'a> {
    One(Holder),
    Many(&'a [Holder], u64, u64),
}

impl HoldersRef<'_> {
    /// (slots holding on any tier, slots holding in GPU memory), over the first 64 slots.
    pub(super) fn masks(&self) -> (u64, u64) {
        match *self {
            HoldersRef::One(h) => {
                let bit = slot_bit(h.slot());
                (bit, if h.on_gpu() { bit } else { 0 })
            }
            HoldersRef::Many(_, any, gpu) => (any, gpu),
        }
    }

    pub(super) fn find(&self, slot: ReplicaSlot) -> Option<Holder> {
        match *self {
            HoldersRef::One(h) => (h.slot() == slot).then_some(h),
            HoldersRef::Many(list, _, _) => list.iter().copied().find(|h| h.slot() == slot),
        }
    }
}

#[derive(Default)]
pub(super) struct Shard {
    one: HashMap<Key, Holder, State>,
    many: HashMap<Key, Shared, State>,
}

impl Shard {
    pub(super) fn get(&self, hash: ExternalHash) -> Option<HoldersRef<'_>> {
        let key = Key::new(hash);
        let holder = *self.one.get(&key)?;
        if !holder.is_marker() {
            return Some(HoldersRef::One(holder));
        }
        self.many.get(&key).map(|m| {
            let (any, gpu) = m.masks();
            HoldersRef::Many(m.list(), any, gpu)
        })
    }

    /// Distinct blocks held by anyone.
    pub(super) fn len(&self) -> usize {
        self.one.len()
    }

    /// Records one store; true when `slot` did not hold the block before.
    pub(super) fn store(
        &mut self,
        hash: ExternalHash,
        slot: ReplicaSlot,
        medium: Medium,
        epoch: u8,
    ) -> bool {
        let key = Key::new(hash);
        let fresh = Holder::new(slot, medium, epoch);
        let Some(entry) = self.one.get_mut(&key) else {
            self.one.insert(key, fresh);
            return true;
        };
        if !entry.is_marker() {
            if entry.slot() == slot {
                *entry = entry
                    .with_refs(medium, entry.refs(medium).saturating_add(1))
                    .with_epoch(epoch);
                return false;
            }
            self.many
                .insert(key, Shared::from_list(vec![*entry, fresh]));
            *entry = Holder::many_marker();
            return true;
        }
        let Some(many) = self.many.get_mut(&key) else {
            // A marker without holders cannot happen; repair by taking the block over.
            *entry = fresh;
            return true;
        };
        many.change(|list| match list.iter_mut().find(|h| h.slot() == slot) {
            Some(h) => {
                *h = h
                    .with_refs(medium, h.refs(medium).saturating_add(1))
                    .with_epoch(epoch);
                false
            }
            None => {
                list.push(fresh);
                true
            }
        })
    }

    /// Records one removal; true when `slot` no longer holds the block.
    pub(super) fn remove(&mut self, hash: ExternalHash, slot: ReplicaSlot, medium: Medium) -> bool {
        let key = Key::new(hash);
        let Some(entry) = self.one.get_mut(&key) else {
            return false;
        };
        if !entry.is_marker() {
            if entry.slot() != slot {
                return false;
            }
            *entry = entry.with_refs(medium, entry.refs(medium).saturating_sub(1));
            if entry.is_empty() {
                self.one.remove(&key);
                return true;
            }
            return false;
        }
        let Some(many) = self.many.get_mut(&key) else {
            return false;
        };
        let gone = many.change(|list| {
            let Some(pos) = list.iter().position(|h| h.slot() == slot) else {
                return false;
            };
            let h = list[pos].with_refs(medium, list[pos].refs(medium).saturating_sub(1));
            if h.is_empty() {
                list.swap_remove(pos);
                true
            } else {
                list[pos] = h;
                false
            }
        });
        match many.list() {
            [] => {
                self.many.remove(&key);
                self.one.remove(&key);
            }
            [only] => {
                *entry = *only;
                self.many.remove(&key);
            }
            _ => {}
        }
        gone
    }

    /// Drops every holder `drop` selects; returns how many.
    pub(super) fn drop_holders(&mut self, mut drop: impl FnMut(Holder) -> bool) -> usize {
        let mut dropped = 0;
        let mut collapsed: Vec<(Key, Option<Holder>)> = Vec::new();
        self.many.retain(|key, many| {
            let before = many.list().len();
            let after = many.change(|list| {
                list.retain(|h| !drop(*h));
                list.len()
            });
            dropped += before - after;
            match many.list() {
                [] => {
                    collapsed.push((*key, None));
                    false
                }
                [only] => {
                    collapsed.push((*key, Some(*only)));
                    false
                }
                _ => true,
            }
        });
        for (key, last) in collapsed {
            match last {
                Some(h) => {
                    self.one.insert(key, h);
                }
                None => {
                    self.one.remove(&key);
                }
            }
        }
        self.one.retain(|_, h| {
            if h.is_marker() || !drop(*h) {
                return true;
            }
            dropped += 1;
            false
        });
        dropped
    }

    /// Every block `slot` holds.
    pub(super) fn blocks_of(&self, slot: ReplicaSlot, out: &mut Vec<ExternalHash>) {
        out.extend(
            self.one
                .iter()
                .filter(|(_, h)| h.slot() == slot)
                .map(|(k, _)| k.block()),
        );
        out.extend(
            self.many
                .iter()
                .filter(|(_, m)| m.list().iter().any(|h| h.slot() == slot))
                .map(|(k, _)| k.block()),
        );
    }
}
