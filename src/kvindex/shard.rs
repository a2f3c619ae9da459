//! One shard of the block map, laid out for memory. A block's first holder lives in the main
//! map's 12-byte bucket (4-byte-aligned key, packed holder) plus hashbrown's control byte; two
//! bits of that holder say where the others are: a second holder in another 12-byte bucket, two
//! or three in a 20-byte one, more in a vector with masks of their slots. So a (block, replica)
//! entry costs 13 bytes of table with one or two holders and 8.5 with four, before the tables'
//! spare room, and a lookup probes one map per extra tier, never a map that misses.

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

/// One replica's hold on one block, packed in 32 bits: where the block's other holders are (2,
/// on the main map's holder only) | slot (14) | GPU references (4) | offloaded references (4) |
/// epoch of the latest store (8). Reference counts saturate at 15: vLLM reports a block stored
/// again only while an earlier copy is still cached, rarely more than twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder(u32);

/// Where a block's holders besides the first are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Others {
    None,
    /// One, in [`Shard::pair`].
    Pair,
    /// Two or three, in [`Shard::few`].
    Few,
    /// Four or more, in [`Shard::lots`].
    Lots,
}

const OTHERS_SHIFT: u32 = 30;
const SLOT_MASK: u32 = 0x3fff;

/// References a holder counts per tier; more copies saturate here (and one removal of this many
/// drops them all).
pub(super) const MAX_REFS: u8 = 15;

/// The first slot the index cannot give out; as a slot, it marks a vacant place.
pub(super) const MAX_SLOTS: usize = SLOT_MASK as usize;

impl Holder {
    /// A vacant place in [`Shard::few`].
    const VACANT: Holder = Holder(SLOT_MASK << 16);

    fn new(slot: ReplicaSlot, medium: Medium, epoch: u8, copies: u8) -> Holder {
        Holder(((u32::from(slot.0) & SLOT_MASK) << 16) | u32::from(epoch)).with_refs(medium, copies)
    }

    pub(super) fn slot(self) -> ReplicaSlot {
        ReplicaSlot(((self.0 >> 16) & SLOT_MASK) as u16)
    }

    fn others(self) -> Others {
        match self.0 >> OTHERS_SHIFT {
            0 => Others::None,
            1 => Others::Pair,
            2 => Others::Few,
            _ => Others::Lots,
        }
    }

    fn with_others(self, others: Others) -> Holder {
        let bits = match others {
            Others::None => 0,
            Others::Pair => 1,
            Others::Few => 2,
            Others::Lots => 3,
        };
        Holder((self.0 & !(3 << OTHERS_SHIFT)) | (bits << OTHERS_SHIFT))
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
        Holder((self.0 & !(0xf << shift)) | (u32::from(refs.min(MAX_REFS)) << shift))
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

    /// `copies` more references on `medium`, dated `epoch`.
    fn stored_again(self, medium: Medium, epoch: u8, copies: u8) -> Holder {
        self.with_refs(medium, self.refs(medium).saturating_add(copies))
            .with_epoch(epoch)
    }

    fn removed(self, medium: Medium, copies: u8) -> Holder {
        self.with_refs(medium, self.refs(medium).saturating_sub(copies))
    }
}

/// Halves a map's table once it is less than a quarter full: amortized O(1) per removal, since
/// a shrink to twice the length needs that many removals again before the next.
fn shrink_if_sparse<V>(map: &mut HashMap<Key, V, State>) {
    if map.capacity() > 1024 && map.len() < map.capacity() / 4 {
        map.shrink_to(map.len() * 2);
    }
}

/// Bit of a slot in the 64-bit holder masks; slots from 64 on have none (lookups over them
/// take the general path).
pub(super) fn slot_bit(slot: ReplicaSlot) -> u64 {
    if slot.0 < 64 { 1 << slot.0 } else { 0 }
}

fn masks_of(list: &[Holder]) -> (u64, u64) {
    list.iter().fold((0, 0), |(any, gpu), h| {
        let bit = slot_bit(h.slot());
        (any | bit, if h.on_gpu() { gpu | bit } else { gpu })
    })
}

/// Most other holders kept in [`Shard::few`].
const FEW: usize = 3;

/// A block's other holders when it has more than [`FEW`] besides the first, with masks of their slots so that a
/// lookup over up to 64 replicas intersects candidate sets in one instruction per block however
/// many hold it.
#[derive(Debug, Clone)]
pub(super) struct Lots {
    any: u64,
    gpu: u64,
    list: Vec<Holder>,
}

/// The holders of one block, as a lookup sees them.
pub(super) enum HoldersRef<'a> {
    One(Holder),
    Two(Holder, Holder),
    Few(Holder, [Holder; FEW]),
    Lots(Holder, &'a Lots),
}

impl HoldersRef<'_> {
    /// (slots holding on any tier, slots holding in GPU memory), over the first 64 slots.
    pub(super) fn masks(&self) -> (u64, u64) {
        match self {
            HoldersRef::One(h) => masks_of(std::slice::from_ref(h)),
            HoldersRef::Two(first, second) => masks_of(&[*first, *second]),
            HoldersRef::Few(first, extra) => {
                let (any, gpu) = masks_of(extra);
                let (first_any, first_gpu) = masks_of(std::slice::from_ref(first));
                (any | first_any, gpu | first_gpu)
            }
            HoldersRef::Lots(first, lots) => {
                let (first_any, first_gpu) = masks_of(std::slice::from_ref(first));
                (lots.any | first_any, lots.gpu | first_gpu)
            }
        }
    }

    pub(super) fn find(&self, slot: ReplicaSlot) -> Option<Holder> {
        self.iter().find(|h| h.slot() == slot)
    }

    /// Every holder, the first one first.
    pub(super) fn iter(&self) -> impl Iterator<Item = Holder> + '_ {
        let (first, extra): (Holder, &[Holder]) = match self {
            HoldersRef::One(h) => (*h, &[]),
            HoldersRef::Two(h, second) => (*h, std::slice::from_ref(second)),
            HoldersRef::Few(h, extra) => (*h, extra),
            HoldersRef::Lots(h, lots) => (*h, &lots.list),
        };
        std::iter::once(first).chain(extra.iter().copied())
    }
}

#[derive(Default)]
pub(super) struct Shard {
    /// Every held block, with its first holder.
    one: HashMap<Key, Holder, State>,
    /// The second holder of blocks held by exactly two replicas.
    pair: HashMap<Key, Holder, State>,
    /// The other holders of blocks held by three or four, [`Holder::VACANT`] where unused.
    few: HashMap<Key, [Holder; FEW], State>,
    /// The other holders of blocks held by five or more.
    lots: HashMap<Key, Lots, State>,
}

impl Shard {
    pub(super) fn get(&self, hash: ExternalHash) -> Option<HoldersRef<'_>> {
        let key = Key::new(hash);
        let first = *self.one.get(&key)?;
        let others = first.others();
        let first = first.with_others(Others::None);
        // A tier without its entry cannot happen; read the block as held by the first only.
        Some(match others {
            Others::None => HoldersRef::One(first),
            Others::Pair => match self.pair.get(&key) {
                Some(second) => HoldersRef::Two(first, *second),
                None => HoldersRef::One(first),
            },
            Others::Few => match self.few.get(&key) {
                Some(few) => HoldersRef::Few(first, *few),
                None => HoldersRef::One(first),
            },
            Others::Lots => match self.lots.get(&key) {
                Some(lots) => HoldersRef::Lots(first, lots),
                None => HoldersRef::One(first),
            },
        })
    }

    /// Distinct blocks held by anyone.
    pub(super) fn len(&self) -> usize {
        self.one.len()
    }

    /// Every holder of a block, taken out of the side maps (the first without its tier bits).
    fn gather(&mut self, key: Key, first: Holder) -> Vec<Holder> {
        let mut list = vec![first.with_others(Others::None)];
        match first.others() {
            Others::None => {}
            Others::Pair => list.extend(self.pair.remove(&key)),
            Others::Few => list.extend(
                self.few
                    .remove(&key)
                    .into_iter()
                    .flatten()
                    .filter(|h| *h != Holder::VACANT),
            ),
            Others::Lots => list.extend(self.lots.remove(&key).into_iter().flat_map(|l| l.list)),
        }
        list
    }

    /// Gives back the room of maps that emptied (tables never shrink by themselves: a block
    /// moving up a tier, or a replica's blocks dropped at a restart, would leave it unused).
    fn shrink_sparse_maps(&mut self) {
        shrink_if_sparse(&mut self.one);
        shrink_if_sparse(&mut self.pair);
        shrink_if_sparse(&mut self.few);
        shrink_if_sparse(&mut self.lots);
    }

    /// Stores `list` as the block's holders, in the tier its length calls for.
    fn scatter(&mut self, key: Key, mut list: Vec<Holder>) {
        let Some(&first) = list.first() else {
            self.one.remove(&key);
            return;
        };
        let others = match list.len() - 1 {
            0 => Others::None,
            1 => {
                self.pair.insert(key, list[1]);
                Others::Pair
            }
            n if n <= FEW => {
                let mut few = [Holder::VACANT; FEW];
                few[..n].copy_from_slice(&list[1..]);
                self.few.insert(key, few);
                Others::Few
            }
            _ => {
                list.remove(0);
                let (any, gpu) = masks_of(&list);
                self.lots.insert(key, Lots { any, gpu, list });
                Others::Lots
            }
        };
        self.one.insert(key, first.with_others(others));
    }

    /// Applies `change` to the holder list of a block; files the holders anew.
    fn change_holders<R>(
        &mut self,
        key: Key,
        first: Holder,
        change: impl FnOnce(&mut Vec<Holder>) -> R,
    ) -> R {
        let mut list = self.gather(key, first);
        let result = change(&mut list);
        self.scatter(key, list);
        self.shrink_sparse_maps();
        result
    }

    /// Records `copies` (at least 1) more references; true when `slot` did not hold the block
    /// before.
    pub(super) fn store(
        &mut self,
        hash: ExternalHash,
        slot: ReplicaSlot,
        medium: Medium,
        epoch: u8,
        copies: u8,
    ) -> bool {
        let key = Key::new(hash);
        let fresh = Holder::new(slot, medium, epoch, copies);
        let Some(entry) = self.one.get_mut(&key) else {
            self.one.insert(key, fresh);
            return true;
        };
        if entry.slot() == slot {
            *entry = entry.stored_again(medium, epoch, copies);
            return false;
        }
        // The common cases in place: a second holder arrives, or one already there stores again.
        match entry.others() {
            Others::None => {
                *entry = entry.with_others(Others::Pair);
                self.pair.insert(key, fresh);
                return true;
            }
            Others::Pair => {
                if let Some(second) = self.pair.get_mut(&key)
                    && second.slot() == slot
                {
                    *second = second.stored_again(medium, epoch, copies);
                    return false;
                }
            }
            Others::Few => {
                if let Some(few) = self.few.get_mut(&key) {
                    if let Some(h) = few.iter_mut().find(|h| h.slot() == slot) {
                        *h = h.stored_again(medium, epoch, copies);
                        return false;
                    }
                    if let Some(vacant) = few.iter_mut().find(|h| **h == Holder::VACANT) {
                        *vacant = fresh;
                        return true;
                    }
                }
            }
            Others::Lots => {
                if let Some(lots) = self.lots.get_mut(&key) {
                    let fresh_holder = match lots.list.iter_mut().find(|h| h.slot() == slot) {
                        Some(h) => {
                            *h = h.stored_again(medium, epoch, copies);
                            false
                        }
                        None => {
                            lots.list.push(fresh);
                            true
                        }
                    };
                    (lots.any, lots.gpu) = masks_of(&lots.list);
                    return fresh_holder;
                }
            }
        }
        // A new holder that moves the block to a larger tier (or a repair): file anew.
        let first = *entry;
        self.change_holders(key, first, |list| {
            match list.iter_mut().find(|h| h.slot() == slot) {
                Some(h) => {
                    *h = h.stored_again(medium, epoch, copies);
                    false
                }
                None => {
                    list.push(fresh);
                    true
                }
            }
        })
    }

    /// Records the removal of `copies` references; true when `slot` no longer holds the block.
    pub(super) fn remove(
        &mut self,
        hash: ExternalHash,
        slot: ReplicaSlot,
        medium: Medium,
        copies: u8,
    ) -> bool {
        let key = Key::new(hash);
        let Some(entry) = self.one.get_mut(&key) else {
            return false;
        };
        if entry.others() == Others::None {
            if entry.slot() != slot {
                return false;
            }
            *entry = entry.removed(medium, copies);
            if entry.is_empty() {
                self.one.remove(&key);
                shrink_if_sparse(&mut self.one);
                return true;
            }
            return false;
        }
        let first = *entry;
        self.change_holders(key, first, |list| {
            let Some(pos) = list.iter().position(|h| h.slot() == slot) else {
                return false;
            };
            let h = list[pos].removed(medium, copies);
            if h.is_empty() {
                list.remove(pos);
                true
            } else {
                list[pos] = h;
                false
            }
        })
    }

    /// Drops every holder `drop` selects; returns how many.
    pub(super) fn drop_holders(&mut self, mut drop: impl FnMut(Holder) -> bool) -> usize {
        let mut dropped = 0;
        let shared: Vec<(Key, Holder)> = self
            .one
            .iter()
            .filter(|(_, h)| h.others() != Others::None)
            .map(|(k, h)| (*k, *h))
            .collect();
        for (key, first) in shared {
            dropped += self.change_holders(key, first, |list| {
                let before = list.len();
                list.retain(|h| !drop(*h));
                before - list.len()
            });
        }
        self.one.retain(|_, h| {
            if h.others() != Others::None || !drop(*h) {
                return true;
            }
            dropped += 1;
            false
        });
        self.shrink_sparse_maps();
        dropped
    }

    /// Every block `slot` holds.
    pub(super) fn blocks_of(&self, slot: ReplicaSlot, out: &mut Vec<ExternalHash>) {
        out.extend(self.one.keys().filter_map(|key| {
            let holders = self.get(key.block())?;
            holders.find(slot).map(|_| key.block())
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_all(shard: &mut Shard, blocks: u64, slot: u16) {
        for b in 0..blocks {
            shard.store(ExternalHash(b), ReplicaSlot(slot), Medium::Gpu, 0, 1);
        }
    }

    #[test]
    fn blocks_move_up_the_tiers_and_emptied_tables_shrink() {
        let mut shard = Shard::default();
        store_all(&mut shard, 10_000, 0);
        store_all(&mut shard, 10_000, 1);
        assert_eq!((shard.pair.len(), shard.few.len()), (10_000, 0));
        store_all(&mut shard, 10_000, 2);
        // Every block moved from `pair` to `few`; `pair`'s table went with them.
        assert_eq!((shard.pair.len(), shard.few.len()), (0, 10_000));
        assert!(shard.pair.capacity() <= 1024, "{}", shard.pair.capacity());
        for slot in 3..6 {
            store_all(&mut shard, 10_000, slot);
        }
        assert_eq!((shard.few.len(), shard.lots.len()), (0, 10_000));
        assert!(shard.few.capacity() <= 1024, "{}", shard.few.capacity());
        let Some(HoldersRef::Lots(first, lots)) = shard.get(ExternalHash(7)) else {
            panic!("six holders are in `lots`");
        };
        assert_eq!(first.slot(), ReplicaSlot(0));
        assert_eq!(lots.list.len(), 5);
        assert_eq!(lots.any, 0b111110);
        // Dropping all but one holder brings every block back to the main map alone.
        let dropped = shard.drop_holders(|h| h.slot() != ReplicaSlot(4));
        assert_eq!(dropped, 50_000);
        assert_eq!((shard.one.len(), shard.lots.len()), (10_000, 0));
        assert!(shard.lots.capacity() <= 1024, "{}", shard.lots.capacity());
        assert!(matches!(
            shard.get(ExternalHash(7)),
            Some(HoldersRef::One(h)) if h.slot() == ReplicaSlot(4)
        ));
        shard.drop_holders(|_| true);
        assert!(shard.one.capacity() <= 1024, "{}", shard.one.capacity());
    }
}
