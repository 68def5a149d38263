//! The device side of a gather plan's scratch page table: [`ScratchTable`] uploads a batch's
//! mapped pages and runs `kvs_scratch_table`, which writes the table (one int64 scratch page per
//! logical page of the shard group) that the attention kernel and `kvs_scratch_rows` read. The
//! CPU reference it is tested against is `crate::shard::GatherPlan::page_table`.

use std::fmt;
use std::sync::Arc;

use crate::abi;
use crate::backend::{i64s_to_bytes, ordered, Backend, Buffer, MemoryKind};
use crate::error::{Checked, Error, Result};
use crate::shard::GatherPlan;

/// A scratch page table on one backend stream, rebuilt per batch: the table and room for up to
/// `capacity` mapped pages of a batch. Every build runs on the table's own backend, so a build's
/// upload is ordered after the previous build's kernel, which still reads the last upload.
pub struct ScratchTable {
    backend: Arc<dyn Backend>,
    logical_pages: u64,
    capacity: usize,
    pages: Buffer,
    scratch: Buffer,
    table: Buffer,
}

impl fmt::Debug for ScratchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScratchTable")
            .field("backend", &self.backend.name())
            .field("logical_pages", &self.logical_pages)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl ScratchTable {
    /// A table of `logical_pages` entries (the shard group's logical pages) for batches of up
    /// to `capacity` mapped pages (prefix and chunk pages), in `backend`'s device memory.
    pub fn new(backend: Arc<dyn Backend>, logical_pages: u64, capacity: usize) -> Result<Self> {
        let bytes = |n: u64, what: &str| -> Result<usize> {
            let b = n.mul_or(8, || format!("bytes of {n} {what}"))?;
            crate::error::to_usize(b.max(8), || format!("bytes of {n} {what}"))
        };
        let table = backend.alloc(bytes(logical_pages, "table entries")?, MemoryKind::Device)?;
        let room = bytes(capacity as u64, "mapped pages")?;
        Ok(Self {
            pages: backend.alloc(room, MemoryKind::Device)?,
            scratch: backend.alloc(room, MemoryKind::Device)?,
            table,
            backend,
            logical_pages,
            capacity,
        })
    }

    /// The backend whose stream builds run on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The table: `int64[logical_pages]`, valid once the stream has passed the last build.
    pub fn table(&self) -> &Buffer {
        &self.table
    }

    /// Entries of the table: the shard group's logical pages.
    pub fn logical_pages(&self) -> u64 {
        self.logical_pages
    }

    /// Most mapped pages a batch may have.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Enqueues the upload of `plan`'s mapped pages and the kernel that writes the table from
    /// them, on the table's backend; nothing waits. The plan must be for this table's logical
    /// pages and map at most its capacity of pages. A bad entry (none of a checked plan's) is
    /// reported by the backend's next `synchronize`.
    pub fn build(&mut self, plan: &GatherPlan) -> Result<()> {
        let n = plan.mapped_pages().len();
        if plan.logical_pages() != self.logical_pages || n > self.capacity {
            return Err(Error::InvalidArgument(format!(
                "a gather plan of {} logical pages mapping {n} pages for a scratch table of {} logical pages and room for {}",
                plan.logical_pages(),
                self.logical_pages,
                self.capacity
            )));
        }
        // Pages and scratch pages are below 2^63: the plan checked them against its int64
        // layout and its logical pages.
        let pages: Vec<i64> = plan.mapped_pages().iter().map(|p| p.0 as i64).collect();
        let scratch: Vec<i64> = plan
            .mapped_scratch_pages()
            .iter()
            .map(|&s| s as i64)
            .collect();
        let backend = self.backend.as_ref();
        backend.enqueue_write(&self.pages, 0, &i64s_to_bytes(&pages))?;
        backend.enqueue_write(&self.scratch, 0, &i64s_to_bytes(&scratch))?;
        let params = abi::kvs_scratch_table_params {
            pages: self.pages.addr(),
            scratch_pages: self.scratch.addr(),
            num_entries: n as u64,
            table: self.table.addr(),
            table_len: self.logical_pages,
            trash_page: plan.layout().trash_page(),
            ..Default::default()
        };
        ordered(
            backend,
            &[self.pages.usage(), self.scratch.usage()],
            &[self.table.usage()],
            || {
                // SAFETY: the three buffers are this table's own device memory on its backend,
                // kept by their usages until the launch has run; `pages` and `scratch` hold
                // `capacity >= n` int64s, written in stream order just before, and the next
                // build's writes are ordered after this kernel; `table` holds `logical_pages`
                // int64s, all the kernel writes.
                unsafe { backend.scratch_table(params) }
            },
        )
    }
}
