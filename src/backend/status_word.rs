//! Host side of `kvs_status`: hands every launch a new epoch and turns the status word back
//! into an error naming the kernel and the first bad input position.

use std::collections::VecDeque;

use crate::abi;
use crate::error::{Error, Result};

/// Epochs handed out before the status word must be cleared and numbering restarts.
const EPOCH_LIMIT: u32 = u32::MAX;

/// Tracks launches since the last check. The status word itself lives in backend memory.
#[derive(Debug)]
pub(crate) struct StatusTracker {
    word: u64,
    next_epoch: u32,
    /// Launches begun, counted without wrapping: what a check through a point of the stream
    /// names ([`StatusTracker::check_through`]).
    launches: u64,
    /// Launches not yet checked: (launch count, epoch, kernel), oldest first.
    pending: VecDeque<(u64, u32, &'static str)>,
}

impl StatusTracker {
    /// A tracker for the status word at `word` (which must hold 0).
    pub(crate) fn new(word: u64) -> Self {
        Self {
            word,
            next_epoch: 1,
            launches: 0,
            pending: VecDeque::new(),
        }
    }

    /// Whether the next launch needs the word cleared first (epochs wrapped). The caller clears
    /// it (stream-ordered) and then calls [`StatusTracker::cleared`].
    pub(crate) fn needs_clear(&self) -> bool {
        self.next_epoch == EPOCH_LIMIT
    }

    pub(crate) fn cleared(&mut self) {
        self.next_epoch = 1;
    }

    /// The status a new launch of `kernel` reports through.
    pub(crate) fn begin(&mut self, kernel: &'static str) -> abi::kvs_status {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        self.launches += 1;
        self.pending.push_back((self.launches, epoch, kernel));
        abi::kvs_status {
            word: self.word,
            epoch,
            reserved: 0,
        }
    }

    /// Checks the word read after all pending launches finished; forgets them either way.
    pub(crate) fn check(&mut self, word: u64) -> Result<()> {
        self.check_through(word, self.launches)
    }

    /// Checks the word read once the launches up to `through` (a [`Self::last_pending`]) had
    /// finished, and none after them had run; forgets those launches either way. Later ones
    /// stay pending for a later check.
    pub(crate) fn check_through(&mut self, word: u64, through: u64) -> Result<()> {
        let epoch = (word >> 32) as u32;
        let position = u64::from(0xFFFF_FFFFu32 - word as u32);
        let checked = self.pending.iter().take_while(|(n, ..)| *n <= through);
        let failed = checked
            .clone()
            .find(|(_, e, _)| *e == epoch)
            .map(|(.., k)| *k);
        let done = checked.count();
        self.pending.drain(..done);
        match failed {
            Some(kernel) => Err(Error::KernelRejected { kernel, position }),
            None => Ok(()),
        }
    }

    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The latest launch not yet checked, `None` when every launch has been.
    pub(crate) fn last_pending(&self) -> Option<u64> {
        self.pending.back().map(|(n, ..)| *n)
    }
}

/// The CPU twin of `kvs::report` in cuda/common.cuh.
pub(crate) fn raise(word: &mut u64, status: &abi::kvs_status, position: u64) {
    if status.word == 0 {
        return;
    }
    let value = (u64::from(status.epoch) << 32) | (0xFFFF_FFFF - position.min(0xFFFF_FFFF));
    *word = (*word).max(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_name_the_kernel_and_smallest_position() {
        let mut t = StatusTracker::new(8);
        let a = t.begin("a");
        let b = t.begin("b");
        let mut word = 0;
        raise(&mut word, &b, 7);
        raise(&mut word, &b, 3);
        raise(&mut word, &a, 1); // older epoch: masked by the newer report, never the reverse
        match t.check(word) {
            Err(Error::KernelRejected { kernel, position }) => {
                assert_eq!((kernel, position), ("b", 3));
            }
            other => panic!("{other:?}"),
        }
        // Old reports do not fail later checks.
        let _ = t.begin("c");
        assert!(t.check(word).is_ok());
    }

    #[test]
    fn a_check_through_a_point_forgets_only_the_launches_before_it() {
        let mut t = StatusTracker::new(8);
        let a = t.begin("a");
        let through = t.last_pending().unwrap();
        let b = t.begin("b");
        // A word read after `a` ran, before `b` did: fine, and `a` is checked.
        assert!(t.check_through(0, through).is_ok());
        assert_eq!(t.last_pending(), Some(through + 1));
        // `b` then fails: the next check through it reports it, once.
        let mut word = 0;
        raise(&mut word, &a, 9);
        raise(&mut word, &b, 4);
        let through = t.last_pending().unwrap();
        match t.check_through(word, through) {
            Err(Error::KernelRejected { kernel, position }) => {
                assert_eq!((kernel, position), ("b", 4));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(t.last_pending(), None);
        assert!(t.check_through(word, through).is_ok());
    }
}
