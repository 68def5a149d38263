//! What the prefill processes of one CP group share on one host: a rendezvous in shared memory.
//!
//! The process that starts the group creates it ([`GroupMemory::create`]) and hands its
//! [`SharedMemory::proc_path`] to every rank, which maps it ([`GroupMemory::join`]). It holds:
//!
//! | bytes | what |
//! |---|---|
//! | 0..8 | magic `KVSGROUP` |
//! | 8..16 | ranks N |
//! | 16..24 | slot bytes S |
//! | 24..32 | 1 once rank 0 published the NCCL id |
//! | 32..160 | the NCCL unique id |
//! | 192 + 64 r | rank r's line: its barrier counter, PID and process start time |
//! | slots + r S | rank r's slot: what it contributes to a host-staged all-gather |
//!
//! The header's words are only ever touched atomically; a slot is written by its rank between two
//! barriers and read by the others after the first, so no byte is read while it is written. A
//! wait ends early with [`Error::PeerGone`] when a rank it waits for has exited (its PID and
//! start time, which every rank records when it joins, checked in `/proc`; the ranks of a group
//! run in one PID namespace), and otherwise with [`Error::Timeout`] at its deadline: never a hang.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Checked, Error, Result};
use crate::ipc::shm::SharedMemory;

const MAGIC: &[u8; 8] = b"KVSGROUP";
const NCCL_READY: usize = 24;
const NCCL_ID: usize = 32;
/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;
const COUNTERS: usize = 192;
const LINE: usize = 64;
/// Slots start on a page of their own.
const SLOT_ALIGN: usize = 4096;
/// Pause between looks at the counters while waiting.
const POLL: Duration = Duration::from_micros(50);
/// How often a wait checks that the ranks it waits for are still there.
const LIVENESS: Duration = Duration::from_millis(10);
/// Offsets in a rank's line.
const PID: usize = 8;
const START: usize = 16;

/// One process's mapping of a CP group's shared memory.
#[derive(Debug)]
pub struct GroupMemory {
    shm: SharedMemory,
    ranks: u32,
    rank: u32,
    slot_bytes: usize,
    /// Barriers this rank has passed.
    step: u64,
    timeout: Duration,
}

fn slots_at(ranks: u32) -> Result<usize> {
    let counters = (ranks as usize).mul_or(LINE, || "group counters".into())?;
    let end = COUNTERS.add_or(counters, || "group header".into())?;
    Ok(end.div_ceil(SLOT_ALIGN) * SLOT_ALIGN)
}

/// Bytes of the shared memory of a group of `ranks` ranks with slots of `slot_bytes`.
pub fn group_bytes(ranks: u32, slot_bytes: usize) -> Result<usize> {
    if ranks == 0 {
        return Err(Error::InvalidArgument("a CP group of 0 ranks".into()));
    }
    let slots = (ranks as usize).mul_or(slot_bytes, || "group slots".into())?;
    slots_at(ranks)?.add_or(slots, || "group memory".into())
}

impl GroupMemory {
    /// Creates the shared memory of a group of `ranks` ranks whose slots hold `slot_bytes` (0:
    /// no host-staged all-gather, only the barrier and the NCCL id). The creator keeps it alive
    /// while the ranks run and gives them its [`SharedMemory::proc_path`].
    pub fn create(ranks: u32, slot_bytes: usize) -> Result<SharedMemory> {
        let len = group_bytes(ranks, slot_bytes)?;
        let shm = SharedMemory::create("kvshard-cp-group", len)?;
        shm.write_at(0, MAGIC)?;
        shm.write_at(8, &u64::from(ranks).to_le_bytes())?;
        shm.write_at(16, &(slot_bytes as u64).to_le_bytes())?;
        Ok(shm)
    }

    /// Maps the group at `path` as rank `rank` of `ranks`, with slots of `slot_bytes`; refuses a
    /// group made for another shape. Waits give up after `timeout`.
    pub fn join(
        path: &Path,
        rank: u32,
        ranks: u32,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if rank >= ranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a CP group of {ranks}"
            )));
        }
        let shm = SharedMemory::open(path, group_bytes(ranks, slot_bytes)?)?;
        let mut header = [0u8; 24];
        shm.read_at(0, &mut header)?;
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or([0; 8]));
        if &header[..8] != MAGIC || word(8) != u64::from(ranks) || word(16) != slot_bytes as u64 {
            return Err(Error::InvalidArgument(format!(
                "{} is not the shared memory of a CP group of {ranks} ranks with {slot_bytes}-byte slots",
                path.display()
            )));
        }
        let group = Self {
            shm,
            ranks,
            rank,
            slot_bytes,
            step: 0,
            timeout,
        };
        let pid = std::process::id();
        let start = i32::try_from(pid)
            .ok()
            .and_then(crate::ipc::proc_stat)
            .and_then(|(_, start)| start)
            .unwrap_or(0);
        group
            .word(group.line(rank) + START)
            .store(start, Ordering::Relaxed);
        group
            .word(group.line(rank) + PID)
            .store(u64::from(pid), Ordering::Release);
        Ok(group)
    }

    fn line(&self, rank: u32) -> usize {
        COUNTERS + rank as usize * LINE
    }

    /// Why rank `rank` can no longer arrive: it joined and its process has exited (or its PID
    /// now names another process). `None` while it runs or has not joined yet.
    fn gone(&self, rank: u32) -> Option<String> {
        let pid = self.word(self.line(rank) + PID).load(Ordering::Acquire);
        let pid = i32::try_from(pid).ok().filter(|&p| p > 0)?;
        let start = self.word(self.line(rank) + START).load(Ordering::Relaxed);
        match crate::ipc::proc_stat(pid) {
            None | Some(('Z' | 'X', _)) => Some(format!("rank {rank} (pid {pid}) exited")),
            Some((_, Some(now))) if start != 0 && now != start => Some(format!(
                "rank {rank} (pid {pid}) exited; its pid names another process"
            )),
            Some(_) => None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks of the group.
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// Bytes of each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The atomic word at `offset` of the header (a multiple of 8 below the slots).
    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= COUNTERS + self.ranks as usize * LINE);
        // SAFETY: the mapping is page-aligned and lives as long as `self`, so `offset` (a
        // multiple of 8 inside the header, as every caller passes) is an aligned, live u64;
        // every process touches these words only through atomics, never through the copies
        // that read and write slots (which start past the header).
        unsafe { &*self.shm.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Waits until `done`, failing as soon as one of the ranks `waited_on` names has exited,
    /// or at the deadline.
    fn wait_until(
        &self,
        what: impl Fn() -> String,
        done: impl Fn() -> bool,
        waited_on: impl Fn() -> Vec<u32>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut looked = start;
        while !done() {
            if looked.elapsed() >= LIVENESS {
                looked = Instant::now();
                let gone = waited_on()
                    .into_iter()
                    .find_map(|r| self.gone(r).map(|why| (r, why)));
                if let Some((rank, why)) = gone {
                    return Err(Error::PeerGone {
                        rank: Some(rank),
                        why: format!("{why} while rank {} waited for {}", self.rank, what()),
                    });
                }
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    what: what(),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Blocks the host until every rank has reached this barrier (the same number of barriers
    /// each), at most the join's timeout.
    pub fn barrier_sync(&mut self) -> Result<()> {
        self.step += 1;
        let step = self.step;
        self.word(self.line(self.rank))
            .store(step, Ordering::Release);
        let behind = || -> Vec<u32> {
            (0..self.ranks)
                .filter(|&r| self.word(self.line(r)).load(Ordering::Acquire) < step)
                .collect()
        };
        self.wait_until(
            || format!("CP group barrier {step} (every rank of {})", self.ranks),
            || behind().is_empty(),
            behind,
        )
    }

    /// Rank 0 publishes the NCCL unique id the others join with.
    pub fn publish_nccl_id(&self, id: &[u8; NCCL_ID_BYTES]) -> Result<()> {
        if self.rank != 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {} publishing the NCCL id (rank 0 does)",
                self.rank
            )));
        }
        self.shm.write_at(NCCL_ID, id)?;
        self.word(NCCL_READY).store(1, Ordering::Release);
        Ok(())
    }

    /// The NCCL unique id rank 0 published, blocking the host until it is there (at most the
    /// join's timeout).
    pub fn nccl_id_sync(&self) -> Result<[u8; NCCL_ID_BYTES]> {
        self.wait_until(
            || "the NCCL id from rank 0".into(),
            || self.word(NCCL_READY).load(Ordering::Acquire) == 1,
            || vec![0],
        )?;
        let mut id = [0u8; NCCL_ID_BYTES];
        self.shm.read_at(NCCL_ID, &mut id)?;
        Ok(id)
    }

    fn slot_offset(&self, rank: u32, len: usize) -> Result<usize> {
        if rank >= self.ranks || len > self.slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes of slot {rank} (a group of {} ranks, {}-byte slots)",
                self.ranks, self.slot_bytes
            )));
        }
        let at = (rank as usize).mul_or(self.slot_bytes, || "a slot offset".into())?;
        slots_at(self.ranks)?.add_or(at, || "a slot offset".into())
    }

    /// Writes `data` at the start of this rank's slot (between two barriers).
    pub fn write_slot(&self, data: &[u8]) -> Result<()> {
        self.shm
            .write_at(self.slot_offset(self.rank, data.len())?, data)
    }

    /// Reads the start of rank `rank`'s slot into `buf` (after the barrier that follows its
    /// write).
    pub fn read_slot(&self, rank: u32, buf: &mut [u8]) -> Result<()> {
        self.shm.read_at(self.slot_offset(rank, buf.len())?, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_at_once_when_a_rank_it_waits_for_has_exited() {
        let shm = GroupMemory::create(2, 0).unwrap();
        let long = Duration::from_secs(60);
        let mut g = GroupMemory::join(&shm.proc_path(), 0, 2, 0, long).unwrap();
        // Rank 1 joined from a process that has exited since (reaped: its PID names nothing,
        // or by now another process with another start time).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        g.word(g.line(1) + START).store(1, Ordering::Relaxed);
        g.word(g.line(1) + PID)
            .store(u64::from(pid), Ordering::Release);
        let start = Instant::now();
        let e = g.barrier_sync().unwrap_err();
        assert!(matches!(e, Error::PeerGone { .. }), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
        // A rank that never joined is waited for until the deadline.
        let other = GroupMemory::create(2, 0).unwrap();
        let short = Duration::from_millis(50);
        let mut alone = GroupMemory::join(&other.proc_path(), 0, 2, 0, short).unwrap();
        assert!(matches!(alone.barrier_sync(), Err(Error::Timeout { .. })));
    }
}
