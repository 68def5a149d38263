//! The CPU twin's streams: per stream a queue of operations, run in one of three orders
//! ([`StreamOrder`]), events as counts of operations run, and waits on events and counters.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

use super::arena::Arena;
use super::twins::{copy_block_unit, BlockLaunch};

/// An operation that runs whole against the arena.
pub(super) type Work = Box<dyn FnOnce(&mut Arena) -> Result<()> + Send>;

/// One queued operation of a stream.
pub(super) enum Op {
    /// Runs whole.
    Run(Work),
    /// `kvs_copy_blocks` or `kvs_copy_blocks_inline`, run unit by unit (unit
    /// `u = k * num_pages + j`, as on the GPU).
    Blocks { launch: Box<BlockLaunch>, next: u64 },
    /// Waits until stream `stream` has run its first `seq` operations.
    WaitEvent { stream: usize, seq: u64 },
    /// Waits until the u32 at `addr` reaches `value` (wrapping compare).
    WaitCounter { addr: u64, value: u32 },
}

#[derive(Default)]
pub(super) struct StreamState {
    pub(super) queue: VecDeque<Op>,
    /// Operations enqueued, and run, so far; `progress` mirrors `executed` for events, which
    /// read it without the arena's lock.
    pub(super) enqueued: u64,
    pub(super) executed: u64,
    pub(super) progress: Arc<AtomicU64>,
    /// The first error a deferred operation met; reported by the next synchronize.
    pub(super) error: Option<Error>,
}

/// When queued work runs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOrder {
    /// Every operation runs when it is enqueued.
    Immediate,
    /// Operations run when something waits for them.
    Deferred,
    /// Deferred, and each host wait runs the other streams first or last, by a coin seeded
    /// with this value.
    Adversarial(u64),
}

impl StreamOrder {
    /// The order `KVSHARD_CPU_STREAMS` names: `immediate` (also when unset), `deferred`,
    /// `adversarial` (seed 0) or `adversarial:SEED`.
    pub fn from_env() -> Result<Self> {
        let value = std::env::var("KVSHARD_CPU_STREAMS").unwrap_or_default();
        match value.as_str() {
            "" | "immediate" => Ok(Self::Immediate),
            "deferred" => Ok(Self::Deferred),
            "adversarial" => Ok(Self::Adversarial(0)),
            other => other
                .strip_prefix("adversarial:")
                .and_then(|seed| seed.parse().ok())
                .map(Self::Adversarial)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "KVSHARD_CPU_STREAMS={other}: expected immediate, deferred, adversarial or adversarial:SEED"
                    ))
                }),
        }
    }
}

pub(super) struct Device {
    pub(super) arena: Arena,
    pub(super) streams: Vec<StreamState>,
    pub(super) order: StreamOrder,
    /// The adversarial coin's state (splitmix64).
    pub(super) coin: u64,
}

pub(super) fn counter_reached(counter: u32, value: u32) -> bool {
    (counter.wrapping_sub(value) as i32) >= 0
}

impl Device {
    /// Runs one step of stream `s`'s first operation: a whole operation, or one unit of a block
    /// copy. Returns whether the stream had anything to run.
    pub(super) fn step(&mut self, s: usize) -> bool {
        let Some(op) = self.streams[s].queue.pop_front() else {
            return false;
        };
        let (result, rest) = match op {
            Op::Run(f) => (f(&mut self.arena), None),
            Op::Blocks { launch, next } => match copy_block_unit(&mut self.arena, &launch, next) {
                Ok(()) if next + 1 < launch.p.num_pages * u64::from(launch.p.num_pairs) => (
                    Ok(()),
                    Some(Op::Blocks {
                        launch,
                        next: next + 1,
                    }),
                ),
                other => (other, None),
            },
            Op::WaitEvent { stream, seq } => (self.run_until(stream, seq), None),
            Op::WaitCounter { addr, value } => (self.wait_counter(s, addr, value), None),
        };
        match rest {
            Some(op) => self.streams[s].queue.push_front(op),
            None => {
                let st = &mut self.streams[s];
                st.executed += 1;
                st.progress.store(st.executed, Ordering::Release);
            }
        }
        if let Err(e) = result {
            self.streams[s].error.get_or_insert(e);
        }
        true
    }

    /// Runs stream `s` until its first `seq` operations have run.
    pub(super) fn run_until(&mut self, s: usize, seq: u64) -> Result<()> {
        while self.streams[s].executed < seq {
            if !self.step(s) {
                break;
            }
        }
        Ok(())
    }

    /// Before the host waits for stream `s`: in adversarial order, a coin decides whether every
    /// other stream's queued work runs now (before `s`) or stays queued (after it).
    pub(super) fn before_host_wait(&mut self, s: usize) {
        if !matches!(self.order, StreamOrder::Adversarial(_)) {
            return;
        }
        // splitmix64: a well-mixed, reproducible sequence from the seed.
        self.coin = self.coin.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.coin;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        if (z ^ (z >> 31)) & 1 == 0 {
            return;
        }
        for other in (0..self.streams.len()).filter(|&o| o != s) {
            let target = self.streams[other].enqueued;
            let _ = self.run_until(other, target);
        }
    }

    /// Runs the other streams, one step at a time (lowest stream first), until the counter at
    /// `addr` reaches `value`; work that can never get it there is an error (it would hang a
    /// GPU).
    pub(super) fn wait_counter(&mut self, waiter: usize, addr: u64, value: u32) -> Result<()> {
        loop {
            let counter = self.arena.u32_at(addr)?;
            if counter_reached(counter, value) {
                return Ok(());
            }
            let busy =
                (0..self.streams.len()).find(|&s| s != waiter && !self.streams[s].queue.is_empty());
            match busy {
                Some(s) => {
                    self.step(s);
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "counter at {addr:#x} is {counter} and can never reach {value}: the wait would hang on a GPU"
                    )))
                }
            }
        }
    }
}
