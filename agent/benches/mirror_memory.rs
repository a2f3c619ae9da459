//! Agent memory per mirrored block: heap bytes held by a `Mirror` (after its pending delta is
//! taken) divided by the distinct blocks it holds, measured with a counting allocator.
//! `cargo bench -p llmgw-agent --bench mirror_memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use llmgw::kvindex::Medium as Tier;
use llmgw_agent::mirror::{BlockKey, GroupIdx, Mirror};
use llmgw_agent::wire::ExternalHash;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() {
    println!("blocks\tbytes/block (steady)\tbytes/block (with pending window)");
    for n in [10_000u64, 100_000, 1_000_000, 4_000_000] {
        let before = LIVE.load(Ordering::Relaxed);
        let mut m = Mirror::new();
        for i in 0..n {
            let stored = m.store(BlockKey {
                hash: ExternalHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                group: GroupIdx(0),
                tier: Tier::Gpu,
            });
            assert!(stored, "within the mirror's ceiling");
        }
        let with_pending = LIVE.load(Ordering::Relaxed) - before;
        let delta = m.take_delta();
        drop(delta);
        let steady = LIVE.load(Ordering::Relaxed) - before;
        println!(
            "{n}\t{:.1}\t{:.1}",
            steady as f64 / n as f64,
            with_pending as f64 / n as f64
        );
        assert_eq!(m.len() as u64, n);
    }
}
