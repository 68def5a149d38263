//! The store inside the asynchronous contract: its `_sync` calls read and write host pages with
//! the CPU (through staging memory), outside every stream, so before they touch the pages they
//! name they wait, on the host, for the work queued on those pages that conflicts: a store
//! reads them, so it waits for their queued writes (a backup still queued behind other work);
//! a load writes them, so it waits for their queued reads and writes (a load to the device
//! still reading them). The host pool's usage record says which work that is, page by page,
//! on every stream; work on other pages of the pool is not waited for.
//!
//! The access itself needs no record: it has ended when the `_sync` call returns, before its
//! caller can enqueue anything after it. (Work another thread enqueues on the same pages while
//! the call runs is that thread's race with it, as with any memory two threads share; the
//! HiCache controller never does that: a node's host pages take no transfer while a storage
//! operation of the node is pending.)

use std::time::{Duration, Instant};

use crate::backend::{host_conflicts, AddressSpace, Backend, Pages};
use crate::copy::space::sealed::Sealed;
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::pool::host::HostPool;

/// Blocks until the work queued on `pages` of `host` that conflicts with a host access (a
/// write when `write`, else a read) has completed, at most until `deadline`
/// ([`Error::Timeout`]). `backend` is the pool's (any stream of its device). On the CPU twin,
/// where queued work runs only when something waits for it, waiting runs it.
pub(super) fn wait_for_queued_sync(
    backend: &dyn Backend,
    host: &HostPool,
    pages: &[LocalPage],
    write: bool,
    deadline: Instant,
) -> Result<()> {
    if pages.is_empty() {
        return Ok(());
    }
    let named = Pages::of(pages.iter().map(|p| p.0));
    let events = host_conflicts(host.usage(), write, &named)?;
    let mut counted = false;
    let started = Instant::now();
    for event in events {
        if backend.is_done(&event)? {
            continue;
        }
        match backend.address_space() {
            // The twin has no device running the work: the wait runs it (bounded CPU work).
            AddressSpace::Cpu(_) => backend.wait_event_sync(&event)?,
            _ => {
                if !std::mem::replace(&mut counted, true) {
                    crate::backend::count_host_sync();
                }
                let mut pause = Duration::from_micros(5);
                while !backend.is_done(&event)? {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout {
                            what: format!(
                                "the work queued on {} host pages before a storage {}",
                                pages.len(),
                                if write { "load" } else { "store" }
                            ),
                            waited: started.elapsed(),
                        });
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(200));
                }
            }
        }
    }
    Ok(())
}
