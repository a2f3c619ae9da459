//! CPU time spent on one piece of async work, such as one routing decision.
//!
//! Wall-clock time of a future counts the time it waits and the time other tasks and processes
//! hold the core; neither is what the work costs. [`CpuTimed`] sums, over each poll of the
//! future it wraps, the polling thread's own CPU time (`CLOCK_THREAD_CPUTIME_ID`: user and
//! system), so it counts exactly the work done inside those polls. Work the future hands to
//! another thread (a tokenization on the blocking pool) is added with [`charge_offloaded`] by
//! the code that awaited it, after measuring it there with [`ThreadCpu`].
//!
//! # Concurrency model
//! Nothing is shared: the running total lives in the wrapper, and the offloaded-work slot is a
//! thread-local that a poll of [`CpuTimed`] installs for its own duration (saved and restored,
//! so wrappers nest) and that only code running inside that poll can reach.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

thread_local! {
    /// CPU time of offloaded work, charged during the current [`CpuTimed`] poll.
    static OFFLOADED: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// The calling thread's CPU time so far (user + system), or zero where the clock is missing.
pub fn thread_cpu_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// A stopwatch of the current thread's CPU time, for work run off the polled thread.
#[derive(Debug, Clone, Copy)]
pub struct ThreadCpu(Duration);

impl ThreadCpu {
    pub fn start() -> ThreadCpu {
        ThreadCpu(thread_cpu_now())
    }

    /// CPU time this thread has used since [`ThreadCpu::start`] (call on the same thread).
    pub fn elapsed(self) -> Duration {
        thread_cpu_now().saturating_sub(self.0)
    }
}

/// Adds CPU time spent on another thread on behalf of the [`CpuTimed`] future being polled; a
/// no-op outside one.
pub fn charge_offloaded(cpu: Duration) {
    OFFLOADED.with(|slot| {
        if let Some(total) = slot.get() {
            slot.set(Some(total + cpu));
        }
    });
}

pin_project_lite::pin_project! {
    /// A future that counts the CPU time of its polls; see the module docs.
    pub struct CpuTimed<F> {
        #[pin]
        inner: F,
        spent: Duration,
    }
}

impl<F> CpuTimed<F> {
    pub fn new(inner: F) -> CpuTimed<F> {
        CpuTimed {
            inner,
            spent: Duration::ZERO,
        }
    }
}

impl<F: Future> Future for CpuTimed<F> {
    /// The inner output and the CPU time it took.
    type Output = (F::Output, Duration);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let outer = OFFLOADED.with(|slot| slot.replace(Some(Duration::ZERO)));
        let started = thread_cpu_now();
        let poll = this.inner.poll(cx);
        let polled = thread_cpu_now().saturating_sub(started);
        let offloaded = OFFLOADED
            .with(|slot| slot.replace(outer))
            .unwrap_or_default();
        *this.spent += polled + offloaded;
        // An enclosing wrapper counts this poll's thread time itself, but not work offloaded
        // from inside it.
        charge_offloaded(offloaded);
        match poll {
            Poll::Ready(output) => Poll::Ready((output, *this.spent)),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns CPU until this thread has used at least `cpu`.
    fn spin(cpu: Duration) {
        let start = ThreadCpu::start();
        let mut x = 0u64;
        while start.elapsed() < cpu {
            for i in 0..1_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            std::hint::black_box(x);
        }
    }

    #[test]
    fn the_thread_clock_moves_with_work() {
        let start = ThreadCpu::start();
        spin(Duration::from_millis(5));
        assert!(start.elapsed() >= Duration::from_millis(5));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn waiting_is_not_counted_work_and_offloaded_work_is() {
        let ((), spent) = CpuTimed::new(async {
            spin(Duration::from_millis(3));
            // Ten (paused, so instant) seconds of waiting cost no CPU.
            tokio::time::sleep(Duration::from_secs(10)).await;
            spin(Duration::from_millis(3));
            charge_offloaded(Duration::from_millis(20));
        })
        .await;
        assert!(spent >= Duration::from_millis(26), "{spent:?}");
        assert!(spent < Duration::from_millis(500), "{spent:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn nested_wrappers_each_see_offloaded_work_once() {
        let ((inner, inner_spent), outer_spent) = CpuTimed::new(async {
            let inner = CpuTimed::new(async { charge_offloaded(Duration::from_millis(40)) }).await;
            charge_offloaded(Duration::from_millis(10));
            inner
        })
        .await;
        let () = inner;
        assert!(inner_spent >= Duration::from_millis(40), "{inner_spent:?}");
        assert!(inner_spent < Duration::from_millis(50), "{inner_spent:?}");
        assert!(outer_spent >= Duration::from_millis(50), "{outer_spent:?}");
        assert!(outer_spent < Duration::from_millis(100), "{outer_spent:?}");
        // Outside any wrapper, a charge goes nowhere.
        charge_offloaded(Duration::from_secs(1));
        assert_eq!(OFFLOADED.with(Cell::get), None);
    }
}
