//! Reading a journal: its header, and its records a bounded chunk at a time.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::super::dir::{How, StoreDir};
use super::super::slots::storage;
use super::records::{Header, Record, CHUNK_RECORDS, HEADER_BYTES, RECORD_BYTES};
use crate::error::{Error, Result, StorageFailure};

/// Reads up to `buf.len()` bytes of `file` at `offset` (fewer only at its end).
pub(super) fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads the whole records of `file` from record place `from` on, [`CHUNK_RECORDS`] at a
/// time, handing each to `each` (its place, and the record or `None` when bad) while `each`
/// returns true. Returns the place after the last record handed over, and whether the file's
/// end was reached (bytes of a partial record there are not handed over).
pub(super) fn scan(
    file: &File,
    path: &Path,
    slots: u64,
    from: u64,
    mut each: impl FnMut(u64, Option<Record>) -> bool,
) -> Result<(u64, bool)> {
    let mut buf = vec![0u8; CHUNK_RECORDS * RECORD_BYTES as usize];
    let mut at = from;
    loop {
        let offset = at
            .checked_mul(RECORD_BYTES)
            .and_then(|b| b.checked_add(HEADER_BYTES))
            .ok_or_else(|| Error::overflow("a journal offset"))?;
        let n = read_full_at(file, &mut buf, offset)
            .map_err(|e| storage(path, StorageFailure::Io, e))?;
        for b in buf[..n].chunks_exact(RECORD_BYTES as usize) {
            if !each(at, Record::decode(b, slots)) {
                return Ok((at, false));
            }
            at += 1;
        }
        if n < buf.len() {
            return Ok((at, true));
        }
    }
}

/// The error of damage met under
/// [`Damaged::Refuse`](super::super::types::Damaged::Refuse).
pub(super) fn corrupt(path: &Path, place: u64) -> Error {
    storage(
        path,
        StorageFailure::Corrupt,
        format!(
            "record {place} is damaged (a failed checksum or a slot past the file) and valid records follow it; DiskConfig::damaged is Refuse"
        ),
    )
}

/// Reads the header of journal `name` in `dir`: `None` when there is none yet (absent, or
/// shorter than a header: created by a writer killed before its header was durable).
pub(in crate::pool::disk) fn read_header(dir: &StoreDir, name: &str) -> Result<Option<Header>> {
    let Some(file) = dir.open_file(name, How::READ)? else {
        return Ok(None);
    };
    let path = dir.file_path(name);
    let mut b = [0u8; HEADER_BYTES as usize];
    let n = read_full_at(&file, &mut b, 0).map_err(|e| storage(&path, StorageFailure::Io, e))?;
    if n < b.len() {
        return Ok(None);
    }
    Header::decode(&b)
        .map(Some)
        .ok_or_else(|| storage(&path, StorageFailure::Format, "no valid journal header"))
}
