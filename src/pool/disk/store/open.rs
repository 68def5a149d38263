//! Opening a [`DiskStore`]: the host buffers' addresses, the directory and its writer lock,
//! the slot file and its alignment, the journal replayed, the files registered with NIXL.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::super::dir::{How, StoreDir};
use super::super::io::FileIo;
use super::super::journal::{self, Header, Journal};
use super::super::key_index::Index;
use super::super::slots::{dio_align, storage, SlotLayout};
use super::super::types::{DiskConfig, DiskStats, MAX_STAGING_BYTES};
use super::{data_name, read_only, DiskStore, DATA_WRITE, NO_WRITER};
use crate::backend::Backend;
use crate::copy::BlockSpace;
use crate::error::{Error, Result, StorageFailure};
use crate::pool::host::HostPool;

impl DiskStore {
    /// Opens rank `config.writer`'s store for pages of `host`: creates the directory (mode
    /// 0700), the journal and the preallocated slot file if missing, takes the rank's writer
    /// lock, replays the journal (a torn tail is cut; damage is skipped and counted, or refused:
    /// [`DiskConfig::damaged`]), and registers the file and the staging memory with NIXL.
    /// `backend` is the host pool's (any stream of its device): a pinned pool on CUDA knows its
    /// buffers' host addresses, a pool on the CPU twin has them from its arena
    /// ([`Backend::host_view`]); the store's `_sync` calls ask it about the work queued on the
    /// pages they name.
    ///
    /// Every file is opened relative to the directory without following a link, and the
    /// directory and its files must be this user's alone (docs/storage.md, "The directory").
    /// The settings are checked before anything is opened ([`DiskConfig::validate`]), and the
    /// slot file is sized only after the journal (when there is one) agreed on the geometry.
    ///
    /// Read-only ([`DiskConfig::read_only`]), nothing is created or written and no lock is
    /// taken: the directory must hold a writer's slot file (the slots' alignment is read from
    /// it), and every writer's journal is replayed (each must agree on the slot size and count).
    ///
    /// Errors, with nothing in the host or device pools touched: [`Error::InvalidArgument`]
    /// (a setting out of its bounds), [`StorageFailure::Open`] (the directory or a file cannot
    /// be made, or the filesystem refuses direct I/O; read-only, the directory holds no slot
    /// file), [`StorageFailure::Untrusted`] (a link, or something another user could write),
    /// [`StorageFailure::Locked`] (another store writes this rank here, its process named),
    /// [`StorageFailure::Full`] (the slots do not fit the free space), [`StorageFailure::Format`]
    /// (the files there are of another slot size, slot count or rank: refused before the slot
    /// file grows), [`StorageFailure::Corrupt`] (damage under [`Damaged::Refuse`]),
    /// [`StorageFailure::Register`] (NIXL has no POSIX backend or refuses the file).
    ///
    /// [`Damaged::Refuse`]: super::super::Damaged::Refuse
    pub fn open(
        host: Arc<HostPool>,
        backend: Arc<dyn Backend>,
        config: DiskConfig,
    ) -> Result<Self> {
        config.validate()?;
        crate::backend::check_space(backend.address_space(), host.address_space(), "host pool")?;
        let bases = host_bases(&host, backend.as_ref())?;
        let dir = StoreDir::open(&config.dir, !config.read_only)?;
        let lock = match config.read_only {
            true => None,
            false => Some(dir.lock_writer(config.writer)?),
        };
        let (own_data, probe) = open_slot_file(&dir, &config)?;
        let (mem_align, offset_align) = dio_align(probe.as_fd());
        drop(probe);
        let layout = SlotLayout::new(&host, mem_align.max(offset_align))?;
        let (bytes, staging) = sizes(&config, &layout)?;
        let header = Header {
            writer: config.writer,
            page_bytes: layout.page_bytes(),
            slot_bytes: layout.slot_bytes(),
            slots: config.slots,
        };
        let mut stats = DiskStats::default();
        let (journal, mut index, fresh) = match &own_data {
            None => (
                None,
                Index::new(config.writers, NO_WRITER, config.slots),
                false,
            ),
            Some(f) => {
                let (journal, index, fresh) =
                    open_own_journal(&dir, &config, header, f, bytes, &mut stats)?;
                (Some(journal), index, fresh)
            }
        };
        index.finish_open();
        let name = format!(
            "kvshard-disk-{}-w{}-{:x}",
            std::process::id(),
            config.writer,
            Arc::as_ptr(&host) as usize
        );
        let mut io = FileIo::new(&name, config.queue, staging, mem_align as usize)?;
        let mut files = vec![None; config.writers as usize];
        if let Some(f) = &own_data {
            let path = dir.file_path(&data_name(config.writer));
            let fd: OwnedFd = f
                .try_clone()
                .map_err(|e| storage(&path, StorageFailure::Open, e))?
                .into();
            files[config.writer as usize] = Some(io.add_file(fd, bytes, &path)?);
        }
        let mut store = Self {
            tails: (0..config.writers).map(|_| None).collect(),
            files,
            config,
            host,
            backend,
            bases,
            layout,
            header,
            io,
            dir,
            journal,
            own_data,
            _lock: lock,
            index,
            stats,
        };
        if store.config.read_only {
            for w in 0..store.config.writers {
                store.catch_up(w, None)?;
            }
        }
        if fresh && store.config.zero_fill {
            store.zero_fill_sync()?;
        }
        Ok(store)
    }

    /// Writes zeros over every slot of this rank's new file ([`DiskConfig::zero_fill`]), a
    /// staging buffer's worth of coalesced descriptors at a time, then syncs it.
    fn zero_fill_sync(&mut self) -> Result<()> {
        let deadline = self.deadline();
        let slot_bytes = self.layout.slot_bytes() as usize;
        let per = 2 * self.config.staging_slots;
        self.io.staging(0, per * slot_bytes)?.fill(0);
        let file = self.files[self.config.writer as usize].unwrap_or_default();
        let slots: Vec<u64> = (0..self.config.slots).collect();
        for chunk in slots.chunks(per) {
            let ios = self.ios(chunk, file, 0);
            let posted = self.io.post(true, &ios)?;
            self.io.wait_sync(posted, deadline)?;
        }
        let data = self.dir.file_path(&data_name(self.config.writer));
        self.own_data
            .as_ref()
            .ok_or_else(|| read_only(&self.config.dir))?
            .sync_data()
            .map_err(|e| storage(&data, journal::io_failure(&e), e))
    }
}

/// Each host buffer's process address: a pinned pool's own, or the backend's view of it (the
/// CPU twin's arena).
fn host_bases(host: &HostPool, backend: &dyn Backend) -> Result<Vec<usize>> {
    (0..host.buffer_layouts().len())
        .map(|b| {
            let m = host.buffer_memory(b)?;
            match (host.host_ptr(b)?, backend.host_view(m.addr(), m.len())?) {
                (Some(p), _) => Ok(p as usize),
                (None, Some(p)) => Ok(p),
                (None, None) => Err(Error::InvalidArgument(
                    "the host pool's buffers have no host address (device memory?)".into(),
                )),
            }
        })
        .collect::<Result<Vec<_>>>()
}

/// This rank's slot file (created empty: nothing grows before the geometry is checked) and a
/// handle to probe its alignment, or, read-only, no file of its own and the first writer's
/// file there as the probe: its alignment is the directory's.
fn open_slot_file(dir: &StoreDir, config: &DiskConfig) -> Result<(Option<File>, File)> {
    Ok(if config.read_only {
        let mut found = None;
        for w in 0..config.writers {
            if let Some(f) = dir.open_file(&data_name(w), How::READ)? {
                found = Some(f);
                break;
            }
        }
        let probe = found.ok_or_else(|| {
            storage(
                dir.path(),
                StorageFailure::Open,
                "no writer's slot file here to open read-only",
            )
        })?;
        (None, probe)
    } else {
        let name = data_name(config.writer);
        let f = dir
            .open_file(&name, DATA_WRITE)?
            .ok_or_else(|| storage(&dir.file_path(&name), StorageFailure::Open, "not created"))?;
        let probe = f
            .try_clone()
            .map_err(|e| storage(&dir.file_path(&name), StorageFailure::Open, e))?;
        (Some(f), probe)
    })
}

/// Bytes of the slot file and of the two staging buffers.
fn sizes(config: &DiskConfig, layout: &SlotLayout) -> Result<(u64, usize)> {
    let bytes = config
        .slots
        .checked_mul(layout.slot_bytes())
        .ok_or_else(|| Error::overflow(format!("{} slots", config.slots)))?;
    let staging = (config.staging_slots as u64)
        .checked_mul(2 * layout.slot_bytes())
        .filter(|&b| b <= MAX_STAGING_BYTES)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{} staging slots of {} B: two buffers of them exceed {MAX_STAGING_BYTES} B",
                config.staging_slots,
                layout.slot_bytes()
            ))
        })? as usize;
    Ok((bytes, staging))
}

/// Opens this rank's journal and replays it into a new index (damage and torn records counted
/// in `stats`), after refusing another geometry before the slot file (`f`) grows to `bytes`.
/// Whether the slot file is new comes back with them.
fn open_own_journal(
    dir: &StoreDir,
    config: &DiskConfig,
    header: Header,
    f: &File,
    bytes: u64,
    stats: &mut DiskStats,
) -> Result<(Journal, Index, bool)> {
    // Another geometry is refused before the slot file grows.
    let name = journal::name(config.writer);
    if let Some(found) = journal::read_header(dir, &name)? {
        if found != header {
            return Err(storage(
                &dir.file_path(&name),
                StorageFailure::Format,
                format!("the journal says {found:?}, this store is {header:?}"),
            ));
        }
    }
    let fresh = preallocate(f, dir, &data_name(config.writer), bytes)?;
    let mut index = Index::new(config.writers, config.writer, config.slots);
    let (journal, opened) = Journal::open(dir, header, config.damaged, &mut |i| {
        index.apply(config.writer, i)
    })?;
    stats.damaged_records = opened.damaged;
    stats.torn_records = opened.torn;
    Ok((journal, index, fresh))
}

/// Makes `file` (entry `name` of `dir`) hold `bytes` bytes of allocated blocks, refusing
/// (before writing anything) when the filesystem has less room than the part still to
/// allocate. Whether it grew the file.
fn preallocate(file: &File, dir: &StoreDir, name: &str, bytes: u64) -> Result<bool> {
    let path = dir.file_path(name);
    let have = file
        .metadata()
        .map_err(|e| storage(&path, StorageFailure::Io, e))?
        .len();
    if have >= bytes {
        return Ok(false);
    }
    let free = dir.free_bytes()?;
    if bytes - have > free {
        return Err(storage(
            &path,
            StorageFailure::Full,
            format!("{} B of slots asked for, {free} B free", bytes - have),
        ));
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
        Ok(()) => Ok(true),
        // A filesystem without fallocate: a sparse file of the right length.
        Err(rustix::io::Errno::OPNOTSUPP) => file
            .set_len(bytes)
            .map(|()| true)
            .map_err(|e| storage(&path, journal::io_failure(&e), e)),
        Err(e) => {
            let _ = file.set_len(have);
            let e = std::io::Error::from(e);
            Err(storage(&path, journal::io_failure(&e), e))
        }
    }
}
