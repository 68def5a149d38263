//! A writer rank's own journal: opened (replayed, damage skipped or refused, the torn tail
//! cut), appended to and compacted.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::super::dir::{How, StoreDir};
use super::super::slots::storage;
use super::super::types::Damaged;
use super::records::{
    compact_name, name, Header, Item, Record, CHUNK_RECORDS, HEADER_BYTES, RECORD_BYTES,
};
use super::scan::{corrupt, read_header, scan};
use crate::error::{Result, StorageFailure};

/// What opening a writer's own journal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(in crate::pool::disk) struct Opened {
    /// Damaged records skipped.
    pub damaged: u64,
    /// Records (whole or partial) cut from the tail.
    pub torn: u64,
}

/// A writer's own journal, open for appending.
#[derive(Debug)]
pub(in crate::pool::disk) struct Journal {
    file: File,
    path: PathBuf,
    writer: u32,
    header: Header,
    /// Record places in the file (valid or damaged; a `Skip` counts one).
    records: u64,
}

impl Journal {
    /// Opens writer `header.writer`'s journal in `dir` (creating it with `header` when absent)
    /// and hands every record place to `apply`, in order (module docs: damage is skipped and
    /// counted, or refused under [`Damaged::Refuse`]); the torn tail is cut so the next append
    /// follows the last valid record.
    pub fn open(
        dir: &StoreDir,
        header: Header,
        damaged: Damaged,
        apply: &mut dyn FnMut(Item),
    ) -> Result<(Self, Opened)> {
        let writer = header.writer;
        let name = name(writer);
        let path = dir.file_path(&name);
        // A compaction killed before its rename: the journal is the old one, whole.
        dir.remove(&compact_name(writer))?;
        let file = dir
            .open_file(&name, How::WRITE)?
            .ok_or_else(|| storage(&path, StorageFailure::Open, "not created"))?;
        let len = file
            .metadata()
            .map_err(|e| storage(&path, StorageFailure::Io, e))?
            .len();
        let journal = |file, records| Self {
            file,
            path: path.clone(),
            writer,
            header,
            records,
        };
        if len < HEADER_BYTES {
            // New (or a header that never reached the disk: no record can follow it).
            file.set_len(0)
                .and_then(|()| file.write_all_at(&header.encode(), 0))
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(&path, io_failure(&e), e))?;
            dir.sync()?;
            return Ok((journal(file, 0), Opened::default()));
        }
        match read_header(dir, &name)? {
            Some(found) if found == header => {}
            found => {
                return Err(storage(
                    &path,
                    StorageFailure::Format,
                    format!("the journal says {found:?}, this store is {header:?}"),
                ))
            }
        }
        let (mut good, mut bad_run) = (0u64, 0u64);
        let mut opened = Opened::default();
        let mut refused = None;
        scan(&file, &path, header.slots, 0, |place, record| {
            match record {
                Some(r) => {
                    if bad_run > 0 {
                        if damaged == Damaged::Refuse {
                            refused = Some(place - bad_run);
                            return false;
                        }
                        (0..bad_run).for_each(|_| apply(Item::Damaged));
                        opened.damaged += bad_run;
                        bad_run = 0;
                    }
                    apply(Item::Record(r));
                    good = place + 1;
                }
                None => bad_run += 1,
            }
            true
        })?;
        if let Some(place) = refused {
            return Err(corrupt(&path, place));
        }
        let end = HEADER_BYTES + good * RECORD_BYTES;
        if len > end {
            // The torn tail (a process killed mid-append): cut so appends stay in step.
            opened.torn = (len - end).div_ceil(RECORD_BYTES);
            file.set_len(end)
                .and_then(|()| file.sync_all())
                .map_err(|e| storage(&path, StorageFailure::Io, e))?;
        }
        Ok((journal(file, good), opened))
    }

    /// Record places in the file (a `Skip` or a damaged record counts one).
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Rewrites the journal as `records` (what [`compacted`] makes of the live index), crash-safe
    /// and link-safe (module docs): written beside it, synced, renamed over it, the directory
    /// synced.
    pub fn compact_sync(&mut self, dir: &StoreDir, records: &[Record]) -> Result<()> {
        let tmp = compact_name(self.writer);
        let tmp_path = dir.file_path(&tmp);
        // Whatever is there (a stray file, or a link someone planted) goes first; the file is
        // then created exclusively, so nothing made in between is written through.
        dir.remove(&tmp)?;
        let file = dir
            .open_file(
                &tmp,
                How {
                    exclusive: true,
                    ..How::WRITE
                },
            )?
            .ok_or_else(|| storage(&tmp_path, StorageFailure::Open, "not created"))?;
        let written = (|| -> std::io::Result<()> {
            file.write_all_at(&self.header.encode(), 0)?;
            let mut at = HEADER_BYTES;
            for chunk in records.chunks(CHUNK_RECORDS) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|r| r.encode()).collect();
                file.write_all_at(&bytes, at)?;
                at += bytes.len() as u64;
            }
            file.sync_all()
        })();
        if let Err(e) = written {
            let _ = dir.remove(&tmp);
            return Err(storage(&tmp_path, io_failure(&e), e));
        }
        dir.rename(&tmp, &name(self.writer))?;
        dir.sync()?;
        self.file = file;
        self.records = records.len() as u64;
        Ok(())
    }

    /// Appends `records` and makes them durable (one `fdatasync`). Returns how many of them
    /// are in the file: all, or, when the write or the sync failed (with the error), the whole
    /// records that made it before a partial one, which is cut. Those stay (other ranks may
    /// have read them already, and positions must mean the same to everyone): the caller
    /// applies them as it would the whole batch.
    pub fn append_sync(&mut self, records: &[Record]) -> (usize, Result<()>) {
        if records.is_empty() {
            return (0, Ok(()));
        }
        let bytes: Vec<u8> = records.iter().flat_map(|r| r.encode()).collect();
        let end = HEADER_BYTES + self.records * RECORD_BYTES;
        match self
            .file
            .write_all_at(&bytes, end)
            .and_then(|()| self.file.sync_data())
        {
            Ok(()) => {
                self.records += records.len() as u64;
                (records.len(), Ok(()))
            }
            Err(e) => {
                let len = self.file.metadata().map_or(end, |m| m.len());
                let kept = (len.saturating_sub(end) / RECORD_BYTES).min(records.len() as u64);
                // A partial record must not stay in front of the next batch.
                let _ = self.file.set_len(end + kept * RECORD_BYTES);
                self.records += kept;
                (kept as usize, Err(storage(&self.path, io_failure(&e), e)))
            }
        }
    }
}

/// Full disk or quota: [`StorageFailure::Full`]; anything else an I/O failure.
pub(in crate::pool::disk) fn io_failure(e: &std::io::Error) -> StorageFailure {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => StorageFailure::Full,
        _ => StorageFailure::Io,
    }
}
