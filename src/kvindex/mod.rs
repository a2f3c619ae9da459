//! The precise KV index: which replicas hold which blocks, as their engines reported them.
//!
//! Fed through [`KvEventSink`] (by the `feed` module from agents, or directly by tests); read by
//! the prefix scorer through [`KvIndex::match_prefix`]. The index knows nothing of gRPC, HTTP or
//! ZMQ, and nothing of models: a block hash already commits to the model's tokens and the
//! engine's hash settings, and a lookup only ever asks about the candidates that serve the
//! request's model.
//!
//! # Concurrency model
//! The block map is split into [`SHARDS`] shards, each a `parking_lot::RwLock<HashMap>`, chosen
//! by the hash's low bits (hashes are uniformly distributed digests). Writers (one feed stream
//! per node) take one shard's write lock per block, briefly. A lookup takes each shard's read
//! lock at most once, lazily, and holds them only for the length of one prompt's walk. The
//! replica table is a separate `RwLock` taken for reads on every change and for writes only
//! when a replica is first seen or the pool changes. Each replica's book (block count, churn,
//! recent evictions, the home memory of a lost cache) is a `parking_lot::Mutex` that a change
//! holds while it writes that replica's blocks (the feed and a lost cache write in slices of
//! 4,096); lookups of churn or homes take it briefly, and a lookup of homes takes no lock at all
//! while no replica has lost its cache within `home_memory` (an atomic count).
//! Lock order: replica table, then the book, then shards in index order; no lock is held across
//! an `.await` (there are none here).
//!
//! # Memory
//! One 12-byte bucket per block hash with its first holder (see `shard`); up to three more
//! holders share one 20-byte bucket of a second map, and more than that are boxed. Each replica has a cap on held blocks; going over it drops
//! that replica's oldest blocks (dated in sixteenths of the cap), found with one scan. A lost
//! cache is remembered as at most [`MAX_HOME_BLOCKS`] hashes (about 1 MB), freed when a lookup
//! finds it older than `home_memory` or at the replica's next loss.

mod shard;
mod speculative;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{RwLock, RwLockReadGuard};
use shard::{Holder, MAX_SLOTS, Shard, slot_bit};
use tokio::time::Instant;

use crate::blockhash::ExternalHash;

pub use llmgw_core::kv_event::{KvEventSink, Medium};

pub use speculative::SpeculativeBlocks;

/// Number of shards in the block map.
pub const SHARDS: usize = 16;

/// The most copies of one block the index counts for one replica in one tier: one per engine
/// (data-parallel rank) of the replica. A replica with more engines would have a block that
/// more of them hold dropped when this many remove it, so the feed refuses engines past it.
pub const MAX_COPIES_PER_REPLICA: usize = shard::MAX_REFS as usize;

/// A wire count as the index's reference count: saturated at the most a holder keeps.
fn refs_of(copies: u32) -> u8 {
    u8::try_from(copies).map_or(shard::MAX_REFS, |c| c.min(shard::MAX_REFS))
}

/// Blocks a lost cache gives back per hold of the replica's book lock.
const LOSS_SLICE: usize = 4096;

/// Why references leave the index: only an engine's own eviction counts as churn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
    Evicted,
    /// A report replaced or withdrawn, or a cache lost whole.
    Withdrawn,
}

/// A replica's dense id inside the index (its position in the replica table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaSlot(u16);

impl ReplicaSlot {
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// How a lookup weighs blocks by tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexConfig {
    /// Most blocks the index keeps for one replica (vLLM's own cache is finite too).
    pub max_blocks_per_replica: u32,
    /// Weight of a block held only offloaded, relative to 1.0 for one in GPU memory.
    pub offloaded_weight: f32,
    /// How long a replica that lost its cache stays the home of what it held
    /// ([`KvIndex::home_prefix`]); zero remembers nothing.
    pub home_memory: Duration,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_blocks_per_replica: 4_000_000,
            offloaded_weight: 0.5,
            home_memory: Duration::from_secs(60),
        }
    }
}

/// The index's options: flags (and `LLMGW_*` variables) with the same names as the
/// configuration file's keys. What neither sets is [`IndexConfig::default`].
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
#[serde(default)]
pub struct IndexOptions {
    /// Most blocks the KV index keeps per replica; the oldest go first (default 4,000,000).
    #[arg(long, env = "LLMGW_INDEX_MAX_BLOCKS_PER_REPLICA")]
    pub index_max_blocks_per_replica: Option<u32>,
    /// Weight of a block held only in CPU (offloaded) memory, relative to GPU (default 0.5).
    #[arg(long, env = "LLMGW_OFFLOADED_WEIGHT")]
    pub offloaded_weight: Option<f32>,
    /// How long a replica whose engine lost its cache (a restart, a cache reset) draws back
    /// the prompts it held, so that its tenants return from where they went meanwhile
    /// (default 60s; 0 turns it off).
    #[arg(long, env = "LLMGW_INDEX_HOME_MEMORY", value_parser = crate::duration::parse)]
    #[serde(default, deserialize_with = "crate::duration::optional")]
    pub index_home_memory: Option<Duration>,
}

impl IndexOptions {
    /// These options (the flags) over `file`'s, over the defaults.
    pub fn resolve(&self, file: &IndexOptions) -> IndexConfig {
        let default = IndexConfig::default();
        IndexConfig {
            max_blocks_per_replica: (self.index_max_blocks_per_replica)
                .or(file.index_max_blocks_per_replica)
                .unwrap_or(default.max_blocks_per_replica),
            offloaded_weight: (self.offloaded_weight)
                .or(file.offloaded_weight)
                .unwrap_or(default.offloaded_weight),
            home_memory: (self.index_home_memory)
                .or(file.index_home_memory)
                .unwrap_or(default.home_memory),
        }
    }
}

/// What one candidate holds of a prompt's leading blocks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixMatch {
    /// Leading blocks held, on any tier.
    pub blocks: u32,
    /// The same blocks weighted by tier (GPU 1.0, offloaded `offloaded_weight`).
    pub weighted: f32,
}

#[derive(Debug, Default)]
struct ReplicaBook {
    /// Blocks held (distinct hashes with any reference).
    blocks: u32,
    /// Blocks stored so far; their count in units of an epoch dates each holder.
    stores: u64,
    churn: ReplicaChurn,
    /// Hashes of recent evictions, by `recent_cell`; 0 is an empty cell.
    recent_evictions: Option<Box<[u64]>>,
    /// What the engine held when it last lost its cache, while that is remembered.
    home: Option<HomeMemory>,
}

/// The blocks a replica held when its engine lost them: the prompts whose home it was. A block
/// the engine evicts again (after computing it anew) leaves the memory: the cache let it go.
#[derive(Debug)]
struct HomeMemory {
    lost_at: Instant,
    blocks: HashSet<u64, foldhash::fast::RandomState>,
}

/// Most blocks remembered per replica (about 1 MB): a larger cache is remembered in part.
pub const MAX_HOME_BLOCKS: usize = 1 << 16;

/// Cells of a replica's table of recent evictions.
pub const RECENT_EVICTIONS: usize = 4096;

/// Blocks in a row not among a replica's recent evictions that end an evicted run
/// ([`KvIndex::evicted_run`]). A cell keeps its hash through `n` later evictions with
/// probability about e^(−n/4096): three quarters after 1,000, under half after 3,300 (ten
/// seconds of a cache that evicts a 66-block prompt five times a second). Ending the run at
/// the first lost cell cut a replica's claim on such a prompt to a few blocks; eight lost
/// cells in a row are rare while the cells still hold half their hashes.
pub const EVICTED_RUN_GAP: usize = 8;

/// The cell of `hash` in a table of recent evictions: its high bits (the low ones choose the
/// shard).
fn recent_cell(hash: ExternalHash) -> usize {
    (hash.0 >> 40) as usize % RECENT_EVICTIONS
}

impl ReplicaBook {
    /// The replica's engine no longer holds `hash` on any tier.
    fn evicted(&mut self, hash: ExternalHash) {
        self.churn.evicted += 1;
        if let Some(home) = &mut self.home {
            home.blocks.remove(&hash.0);
        }
        let table = self
            .recent_evictions
            .get_or_insert_with(|| vec![0; RECENT_EVICTIONS].into_boxed_slice());
        table[recent_cell(hash)] = hash.0;
    }

    /// The replica's engine holds `hash` again (it held none of it before this store).
    fn stored_new(&mut self, hash: ExternalHash) {
        if let Some(table) = &mut self.recent_evictions {
            let cell = &mut table[recent_cell(hash)];
            if *cell == hash.0 && hash.0 != 0 {
                *cell = 0;
                self.churn.rebuilt += 1;
            }
        }
    }
}

/// A replica's cumulative eviction counts since the index first saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicaChurn {
    /// Blocks its engine removed from every tier (evictions; a clear is not counted).
    pub evicted: u64,
    /// Blocks its engine stored again while still among its recent evictions: prefixes it
    /// dropped and then had to compute again.
    pub rebuilt: u64,
}

/// Epochs per block cap: holders are dated to 1/16 of the cap, and the oldest go first.
const EPOCHS_PER_CAP: u64 = 16;

#[derive(Debug, Default)]
struct ReplicaTable {
    by_name: HashMap<String, ReplicaSlot>,
    names: Vec<String>,
    books: Vec<parking_lot::Mutex<ReplicaBook>>,
    /// Per slot, since when its replica has been out of the pool ([`KvIndex::pool_changed`]);
    /// `None` while it is in the pool, or when the index was never told.
    absent_since: Vec<Option<Instant>>,
}

/// How long a replica must have been out of the pool, holding no block, before a full replica
/// table gives its slot to a new replica: longer than any state kept per slot lives (speculative
/// picks for seconds, placements fading with a 300 s time constant, lends for `lend_memory`,
/// 60 s as measured), so the new replica inherits none of it.
pub const SLOT_QUARANTINE: Duration = Duration::from_secs(3600);

/// Errors from the index.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvIndexError {
    #[error(
        "the index holds at most {max} replicas; a departed one's slot is free an hour after it left the pool holding no block"
    )]
    TooManyReplicas { max: usize },
}

/// The precise index. Cheap to share behind an `Arc`.
pub struct KvIndex {
    config: IndexConfig,
    shards: Box<[RwLock<Shard>]>,
    replicas: RwLock<ReplicaTable>,
    /// Replicas with a home memory: while there are none (almost always), a lookup of homes
    /// takes no lock.
    homes: AtomicUsize,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("config", &self.config)
            .field("replicas", &self.replicas.read().names.len())
            .finish_non_exhaustive()
    }
}

impl KvIndex {
    pub fn new(config: IndexConfig) -> Self {
        KvIndex {
            config,
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            replicas: RwLock::new(ReplicaTable::default()),
            homes: AtomicUsize::new(0),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    fn shard_of(hash: ExternalHash) -> usize {
        (hash.0 as usize) % SHARDS
    }

    /// The slot of a replica the index has seen.
    pub fn slot(&self, replica: &str) -> Option<ReplicaSlot> {
        self.replicas.read().by_name.get(replica).copied()
    }

    /// The slot of a replica, registering it when new.
    pub fn slot_or_insert(&self, replica: &str) -> Result<ReplicaSlot, KvIndexError> {
        if let Some(slot) = self.slot(replica) {
            return Ok(slot);
        }
        let mut table = self.replicas.write();
        if let Some(slot) = table.by_name.get(replica) {
            return Ok(*slot);
        }
        // The last u16 value marks shared blocks inside a shard.
        let Some(index) = u16::try_from(table.names.len())
            .ok()
            .filter(|&i| usize::from(i) < MAX_SLOTS)
        else {
            return self.reuse_slot(&mut table, replica, Instant::now());
        };
        let slot = ReplicaSlot(index);
        table.by_name.insert(replica.to_owned(), slot);
        table.names.push(replica.to_owned());
        table
            .books
            .push(parking_lot::Mutex::new(ReplicaBook::default()));
        table.absent_since.push(None);
        Ok(slot)
    }

    /// With every slot taken, gives `replica` the slot of one that left the pool at least
    /// [`SLOT_QUARANTINE`] ago and holds no block (a long-lived router in a fleet whose replicas
    /// come and go: each new pod is a new address).
    fn reuse_slot(
        &self,
        table: &mut ReplicaTable,
        replica: &str,
        now: Instant,
    ) -> Result<ReplicaSlot, KvIndexError> {
        let departed = (0..table.names.len()).find(|&i| {
            table.absent_since[i]
                .is_some_and(|since| now.saturating_duration_since(since) >= SLOT_QUARANTINE)
                && table.books[i].lock().blocks == 0
        });
        let Some(index) = departed else {
            return Err(KvIndexError::TooManyReplicas { max: MAX_SLOTS });
        };
        let slot = ReplicaSlot(
            u16::try_from(index).map_err(|_| KvIndexError::TooManyReplicas { max: MAX_SLOTS })?,
        );
        let old = std::mem::replace(&mut table.names[index], replica.to_owned());
        table.by_name.remove(&old);
        table.by_name.insert(replica.to_owned(), slot);
        table.absent_since[index] = None;
        let book = std::mem::take(&mut *table.books[index].lock());
        if book.home.is_some() {
            self.homes.fetch_sub(1, Ordering::Relaxed);
        }
        // The count says nothing is left; the scan makes sure no holder of the old replica
        // could pass for the new one's (once per reuse, rare: the table must be full).
        self.drop_holders(|h| h.slot() == slot);
        tracing::info!(
            departed = %old,
            %replica,
            "the KV index is full: a departed replica's slot goes to a new one"
        );
        Ok(slot)
    }

    /// The pool now holds `present` (replica addresses, `host:port`): every other replica the
    /// index knows is out of it from `now` on (unless it already was), and its slot may be
    /// given to a new replica once [`SLOT_QUARANTINE`] has passed and it holds no block.
    pub fn pool_changed(&self, present: &HashSet<String>, now: Instant) {
        let mut table = self.replicas.write();
        let ReplicaTable {
            names,
            absent_since,
            ..
        } = &mut *table;
        for (name, absent) in names.iter().zip(absent_since.iter_mut()) {
            if present.contains(name) {
                *absent = None;
            } else if absent.is_none() {
                *absent = Some(now);
            }
        }
    }

    /// Blocks the index believes `replica` holds.
    pub fn replica_block_count(&self, replica: &str) -> u64 {
        let table = self.replicas.read();
        match table.by_name.get(replica) {
            Some(slot) => u64::from(table.books[slot.index()].lock().blocks),
            None => 0,
        }
    }

    /// Blocks the index believes the replica in `slot` holds.
    pub fn block_count(&self, slot: ReplicaSlot) -> u64 {
        let table = self.replicas.read();
        table
            .books
            .get(slot.index())
            .map_or(0, |book| u64::from(book.lock().blocks))
    }

    /// The eviction counts of the replica in `slot`.
    pub fn churn(&self, slot: ReplicaSlot) -> ReplicaChurn {
        let table = self.replicas.read();
        table
            .books
            .get(slot.index())
            .map_or_else(ReplicaChurn::default, |book| book.lock().churn)
    }

    /// How many of `hashes` the replica in `slot` evicted recently (and has not stored since):
    /// blocks a request sent there would make it compute again.
    pub fn recently_evicted(&self, slot: ReplicaSlot, hashes: &[ExternalHash]) -> usize {
        self.with_recent_evictions(slot, |evicted| {
            hashes.iter().filter(|&&h| evicted(h)).count()
        })
    }

    /// How many leading blocks of `hashes` the replica in `slot` evicted recently (and has not
    /// stored since): given the blocks after those it holds, the rest of the prefix it held
    /// moments ago. The run reaches the last such block before [`EVICTED_RUN_GAP`] blocks in a
    /// row that are not among the recent evictions, and counts the blocks between: the table
    /// is direct-mapped, so a block evicted moments ago may have lost its cell to a later
    /// eviction, and since a block's hash chains its whole prefix, an evicted block further on
    /// means the replica held the ones before it too. A prompt that continues what the
    /// replica holds with new blocks costs [`EVICTED_RUN_GAP`] probes.
    pub fn evicted_run(&self, slot: ReplicaSlot, hashes: &[ExternalHash]) -> usize {
        self.with_recent_evictions(slot, |evicted| {
            let mut run = 0;
            for (i, &hash) in hashes.iter().enumerate() {
                if evicted(hash) {
                    run = i + 1;
                } else if i - run + 1 >= EVICTED_RUN_GAP {
                    break;
                }
            }
            run
        })
    }

    /// `count` given whether a hash is among the replica's recent evictions; 0 for a replica
    /// that evicted nothing.
    fn with_recent_evictions(
        &self,
        slot: ReplicaSlot,
        count: impl FnOnce(&dyn Fn(ExternalHash) -> bool) -> usize,
    ) -> usize {
        let table = self.replicas.read();
        let Some(book) = table.books.get(slot.index()) else {
            return 0;
        };
        let book = book.lock();
        let Some(recent) = &book.recent_evictions else {
            return 0;
        };
        count(&|h: ExternalHash| h.0 != 0 && recent[recent_cell(h)] == h.0)
    }

    /// Every (replica, eviction counts) pair, for metrics.
    pub fn replica_churn(&self) -> Vec<(String, ReplicaChurn)> {
        let table = self.replicas.read();
        table
            .names
            .iter()
            .zip(&table.books)
            .map(|(name, book)| (name.clone(), book.lock().churn))
            .collect()
    }

    /// Distinct block hashes in the index (across replicas).
    pub fn distinct_blocks(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Every (replica, block count) pair, for metrics.
    pub fn replica_block_counts(&self) -> Vec<(String, u64)> {
        let table = self.replicas.read();
        table
            .names
            .iter()
            .zip(&table.books)
            .map(|(name, book)| (name.clone(), u64::from(book.lock().blocks)))
            .collect()
    }

    /// The hashes the index believes `replica` holds, sorted (for `/debug` and tests).
    pub fn replica_blocks(&self, replica: &str) -> Vec<ExternalHash> {
        let Some(slot) = self.slot(replica) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            shard.read().blocks_of(slot, &mut out);
        }
        out.sort_unstable();
        out
    }

    fn epoch_len(&self) -> u64 {
        (u64::from(self.config.max_blocks_per_replica) / EPOCHS_PER_CAP).max(1)
    }

    fn store(
        &self,
        slot: ReplicaSlot,
        blocks: impl Iterator<Item = (ExternalHash, u32)>,
        medium: Medium,
    ) {
        let table = self.replicas.read();
        let mut book = table.books[slot.index()].lock();
        let epoch_len = self.epoch_len();
        for (hash, copies) in blocks.filter(|&(_, copies)| copies > 0) {
            let epoch = (book.stores / epoch_len) as u8;
            book.stores += 1;
            if self.shards[Self::shard_of(hash)].write().store(
                hash,
                slot,
                medium,
                epoch,
                refs_of(copies),
            ) {
                book.blocks += 1;
                book.stored_new(hash);
            }
        }
        let cap = self.config.max_blocks_per_replica;
        if book.blocks > cap {
            // Drop the oldest epochs first: everything dated 14 epochs back or more leaves at
            // most 14/16 of the cap (epochs are stores, and blocks are at most stores). Epochs
            // wrap after 256, so should that not suffice, younger epochs follow.
            let current = (book.stores / epoch_len) as u8;
            let mut dropped = 0;
            for min_age in [14u8, 12, 8, 4, 1, 0] {
                dropped += self.drop_holders(|h| {
                    h.slot() == slot && current.wrapping_sub(h.epoch()) >= min_age
                });
                book.blocks = book
                    .blocks
                    .saturating_sub(u32::try_from(dropped).unwrap_or(u32::MAX));
                dropped = 0;
                if book.blocks <= cap {
                    break;
                }
            }
            tracing::warn!(
                replica = %table.names[slot.index()],
                held = book.blocks,
                cap,
                "replica over its block cap: dropped its oldest blocks from the index"
            );
        }
    }

    fn remove(
        &self,
        slot: ReplicaSlot,
        blocks: impl Iterator<Item = (ExternalHash, u32)>,
        medium: Medium,
        why: Removal,
    ) {
        let table = self.replicas.read();
        let mut book = table.books[slot.index()].lock();
        Self::remove_locked(&self.shards, slot, &mut book, blocks, medium, why);
    }

    /// [`remove`](Self::remove) with the replica's book already locked.
    fn remove_locked(
        shards: &[RwLock<Shard>],
        slot: ReplicaSlot,
        book: &mut ReplicaBook,
        blocks: impl Iterator<Item = (ExternalHash, u32)>,
        medium: Medium,
        why: Removal,
    ) {
        for (hash, copies) in blocks.filter(|&(_, copies)| copies > 0) {
            if shards[Self::shard_of(hash)]
                .write()
                .remove(hash, slot, medium, refs_of(copies))
            {
                book.blocks = book.blocks.saturating_sub(1);
                if why == Removal::Evicted {
                    book.evicted(hash);
                }
            }
        }
    }

    fn clear(&self, slot: ReplicaSlot) {
        let table = self.replicas.read();
        let mut book = table.books[slot.index()].lock();
        self.drop_all(slot, &mut book);
    }

    /// One engine of the replica in `slot` lost `blocks`: one reference fewer to each, and they
    /// are remembered as that replica's home (unless there are none: a second loss before the
    /// engine cached anything keeps the first memory). Only these blocks are touched, so a
    /// replica's loss costs lookups no scan of the index.
    fn lose_blocks(&self, slot: ReplicaSlot, blocks: &[(ExternalHash, Medium)]) {
        {
            let table = self.replicas.read();
            let mut book = table.books[slot.index()].lock();
            // The engine recomputes what it held because it lost everything, not because its
            // cache is too small.
            book.recent_evictions = None;
            if !self.config.home_memory.is_zero() && !blocks.is_empty() {
                let memory = HomeMemory {
                    lost_at: Instant::now(),
                    blocks: blocks
                        .iter()
                        .map(|(hash, _)| hash.0)
                        .take(MAX_HOME_BLOCKS)
                        .collect(),
                };
                if book.home.replace(memory).is_none() {
                    self.homes.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // In slices, each under its own locks, so that lookups of the replica's churn and home
        // and a new replica's registration pass between them.
        for slice in blocks.chunks(LOSS_SLICE) {
            let table = self.replicas.read();
            let mut book = table.books[slot.index()].lock();
            for medium in [Medium::Gpu, Medium::Offloaded] {
                let tier = slice
                    .iter()
                    .filter(|(_, m)| *m == medium)
                    .map(|&(hash, _)| (hash, 1));
                Self::remove_locked(
                    &self.shards,
                    slot,
                    &mut book,
                    tier,
                    medium,
                    Removal::Withdrawn,
                );
            }
        }
    }

    /// How many of the prompt's leading blocks the replica in `slot` held when its engine last
    /// lost its cache, if that was less than `home_memory` ago: it is those prompts' home, and
    /// the copies other replicas made while it was gone are refugees. Blocks it evicted since
    /// (after computing them again) do not count. 0 when it remembers nothing.
    pub fn home_prefix(&self, slot: ReplicaSlot, prompt: &[ExternalHash], now: Instant) -> u32 {
        if self.homes.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let table = self.replicas.read();
        let Some(book) = table.books.get(slot.index()) else {
            return 0;
        };
        let mut book = book.lock();
        let Some(home) = &book.home else {
            return 0;
        };
        if now.saturating_duration_since(home.lost_at) > self.config.home_memory {
            book.home = None;
            self.homes.fetch_sub(1, Ordering::Relaxed);
            return 0;
        }
        prompt
            .iter()
            .take_while(|h| home.blocks.contains(&h.0))
            .count() as u32
    }

    /// Drops every block of the replica in `slot`, whose book `book` is.
    fn drop_all(&self, slot: ReplicaSlot, book: &mut ReplicaBook) {
        self.drop_holders(|h| h.slot() == slot);
        book.blocks = 0;
        // A cleared (or restarted) engine recomputes what it held because it lost everything,
        // not because its cache is too small.
        book.recent_evictions = None;
    }

    /// Removes every holder `drop` selects, shard by shard; returns how many.
    fn drop_holders(&self, mut drop: impl FnMut(Holder) -> bool) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.write().drop_holders(&mut drop))
            .sum()
    }

    /// For each candidate, how many of the prompt's leading blocks it holds (and their tier
    /// weight). `out[i]` answers for `candidates[i]`; a candidate the index never saw holds
    /// nothing. Allocation-free apart from `out` when there are at most 64 candidates.
    pub fn match_prefix(
        &self,
        prompt: &[ExternalHash],
        candidates: &[Option<ReplicaSlot>],
        out: &mut Vec<PrefixMatch>,
    ) {
        out.clear();
        out.resize(candidates.len(), PrefixMatch::default());
        if candidates.iter().flatten().all(|slot| slot.0 < 64) {
            self.match_prefix_masked(prompt, candidates, out);
        } else {
            self.match_prefix_general(prompt, candidates, out);
        }
    }

    /// Every candidate among the first 64 slots: candidate sets are 64-bit masks, and a block
    /// costs one map lookup and a few mask operations, however many replicas hold it.
    fn match_prefix_masked(
        &self,
        prompt: &[ExternalHash],
        candidates: &[Option<ReplicaSlot>],
        out: &mut [PrefixMatch],
    ) {
        let mut guards: [Option<RwLockReadGuard<'_, Shard>>; SHARDS] = Default::default();
        let mut alive = candidates
            .iter()
            .flatten()
            .map(|s| slot_bit(*s))
            .fold(0, |a, b| a | b);
        // Per slot: leading blocks held, and how many of them only offloaded.
        let mut held = [0u32; 64];
        let mut offloaded = [0u32; 64];
        let mut walked = 0u32;
        for hash in prompt {
            if alive == 0 {
                break;
            }
            let shard_index = Self::shard_of(*hash);
            let shard = guards[shard_index].get_or_insert_with(|| self.shards[shard_index].read());
            let (any, gpu) = shard.get(*hash).map_or((0, 0), |h| h.masks());
            let mut dropped = alive & !any;
            while dropped != 0 {
                held[dropped.trailing_zeros() as usize] = walked;
                dropped &= dropped - 1;
            }
            alive &= any;
            let mut off = alive & !gpu;
            while off != 0 {
                offloaded[off.trailing_zeros() as usize] += 1;
                off &= off - 1;
            }
            walked += 1;
        }
        while alive != 0 {
            held[alive.trailing_zeros() as usize] = walked;
            alive &= alive - 1;
        }
        for (m, slot) in out.iter_mut().zip(candidates) {
            if let Some(slot) = slot {
                let i = slot.index();
                m.blocks = held[i];
                m.weighted = (held[i] - offloaded[i]) as f32
                    + offloaded[i] as f32 * self.config.offloaded_weight;
            }
        }
    }

    /// Any number of replicas: each block's holders are walked once and matched to candidates
    /// through a slot → candidate table (walking the holders once per candidate would cost
    /// holders × candidates per block: ~0.8 ms for 32 blocks held by 256 replicas).
    fn match_prefix_general(
        &self,
        prompt: &[ExternalHash],
        candidates: &[Option<ReplicaSlot>],
        out: &mut [PrefixMatch],
    ) {
        let Some(max_slot) = candidates.iter().flatten().map(|s| s.index()).max() else {
            return;
        };
        let mut candidate_of = vec![u32::MAX; max_slot + 1];
        let mut alive: smallbitset::Bits = smallbitset::Bits::new(candidates.len());
        for (i, slot) in candidates.iter().enumerate() {
            if let Some(slot) = slot {
                candidate_of[slot.index()] = i as u32;
                alive.set(i);
            }
        }
        // Per candidate: the last block (numbered from 1) among whose holders it was seen, and
        // whether that copy is in GPU memory.
        let mut seen_at = vec![0u32; candidates.len()];
        let mut on_gpu = vec![false; candidates.len()];
        let mut guards: [Option<RwLockReadGuard<'_, Shard>>; SHARDS] = Default::default();
        for (block, hash) in (1u32..).zip(prompt) {
            if alive.is_empty() {
                break;
            }
            let shard_index = Self::shard_of(*hash);
            let shard = guards[shard_index].get_or_insert_with(|| self.shards[shard_index].read());
            let Some(holders) = shard.get(*hash) else {
                break;
            };
            for holder in holders.iter() {
                if let Some(&i) = candidate_of.get(holder.slot().index())
                    && let Some(seen) = seen_at.get_mut(i as usize)
                {
                    *seen = block;
                    on_gpu[i as usize] = holder.on_gpu();
                }
            }
            for w in 0..alive.word_count() {
                let mut bits = alive.word(w);
                while bits != 0 {
                    let i = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if seen_at[i] == block {
                        let m = &mut out[i];
                        m.blocks += 1;
                        m.weighted += if on_gpu[i] {
                            1.0
                        } else {
                            self.config.offloaded_weight
                        };
                    } else {
                        alive.clear(i);
                    }
                }
            }
        }
    }
}

impl KvEventSink for KvIndex {
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        match self.slot_or_insert(replica) {
            Ok(slot) => self.store(slot, blocks.iter().copied(), medium),
            Err(err) => tracing::error!(%replica, %err, "blocks not indexed"),
        }
    }

    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        if let Some(slot) = self.slot(replica) {
            self.remove(slot, blocks.iter().copied(), medium, Removal::Evicted);
        }
    }

    fn withdrawn_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        if let Some(slot) = self.slot(replica) {
            self.remove(slot, blocks.iter().copied(), medium, Removal::Withdrawn);
        }
    }

    fn lost_blocks(&self, replica: &str, blocks: &[(ExternalHash, Medium)]) {
        if let Some(slot) = self.slot(replica) {
            self.lose_blocks(slot, blocks);
        }
    }

    fn stored(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        match self.slot_or_insert(replica) {
            Ok(slot) => self.store(slot, hashes.iter().map(|&h| (h, 1)), medium),
            Err(err) => tracing::error!(%replica, %err, "blocks not indexed"),
        }
    }

    fn removed(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        if let Some(slot) = self.slot(replica) {
            self.remove(
                slot,
                hashes.iter().map(|&h| (h, 1)),
                medium,
                Removal::Evicted,
            );
        }
    }

    fn cleared(&self, replica: &str) {
        if let Some(slot) = self.slot(replica) {
            self.clear(slot);
        }
    }

    fn reporting(&self, replica: &str) {
        if let Err(err) = self.slot_or_insert(replica) {
            tracing::error!(%replica, %err, "replica not indexed");
        }
    }
}

/// A candidate set as a bitset: inline up to 64 candidates, on the heap beyond.
mod smallbitset {
    pub(super) enum Bits {
        Inline(u64),
        Heap(Vec<u64>),
    }

    impl Bits {
        pub(super) fn new(len: usize) -> Self {
            if len <= 64 {
                Bits::Inline(0)
            } else {
                Bits::Heap(vec![0; len.div_ceil(64)])
            }
        }

        fn words_mut(&mut self) -> &mut [u64] {
            match self {
                Bits::Inline(w) => std::slice::from_mut(w),
                Bits::Heap(v) => v,
            }
        }

        fn words(&self) -> &[u64] {
            match self {
                Bits::Inline(w) => std::slice::from_ref(w),
                Bits::Heap(v) => v,
            }
        }

        pub(super) fn set(&mut self, i: usize) {
            self.words_mut()[i / 64] |= 1 << (i % 64);
        }

        pub(super) fn clear(&mut self, i: usize) {
            self.words_mut()[i / 64] &= !(1 << (i % 64));
        }

        pub(super) fn is_empty(&self) -> bool {
            self.words().iter().all(|w| *w == 0)
        }

        pub(super) fn word_count(&self) -> usize {
            self.words().len()
        }

        pub(super) fn word(&self, w: usize) -> u64 {
            self.words()[w]
        }
    }
}
