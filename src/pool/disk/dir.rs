//! The store's directory, handled as a database handles its own (docs/storage.md, "The
//! directory"): opened once, every file opened relative to it without following links, nothing
//! in it that another user could change, one writer per rank.
//!
//! - **No links.** The directory is opened with `O_NOFOLLOW` on its last component (the
//!   components above it are the caller's choice), and every file in it with `openat2` and
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, or with `O_NOFOLLOW` from the directory's
//!   descriptor where the kernel has no `openat2` (before Linux 5.6) or a seccomp filter refuses
//!   it (file names are single components, so the two refuse the same links). A link planted at
//!   a slot file, a journal, the compaction file or a lock file is refused, never followed. A
//!   file with more than one hard link is refused too (a hard link can name a file outside the
//!   directory). Renames and removals name entries of the descriptor (`renameat`, `unlinkat`),
//!   which never follow a link.
//! - **Nothing another user can write.** The directory and every file must be owned by the
//!   process's effective user and not writable by group or others, or the store refuses them
//!   ([`StorageFailure::Untrusted`]). The checks read the open descriptor (`fstat`), so nothing
//!   can be swapped in between the check and the use.
//! - **One writer per rank.** A writer holds an exclusive `flock` on `wNNNN.lock` for as long as
//!   its store is open (the kernel drops it when the store closes or its process dies) and
//!   writes its process id into it; a second writer of that rank gets
//!   [`StorageFailure::Locked`] naming the holder. `flock` locks belong to the open file
//!   description, so two stores of one process exclude each other too. Read-only stores take
//!   no lock.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::slots::storage;
use crate::error::{Error, Result, StorageFailure};

/// How a file of the directory is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct How {
    /// Read and write (else read only).
    pub write: bool,
    /// Created (mode 0600) when absent.
    pub create: bool,
    /// Created, and refused when the name exists (`O_EXCL`).
    pub exclusive: bool,
    /// Direct I/O (`O_DIRECT`).
    pub direct: bool,
}

impl How {
    /// Read only; absent is `None`.
    pub const READ: How = How {
        write: false,
        create: false,
        exclusive: false,
        direct: false,
    };
    /// Read and write, created when absent.
    pub const WRITE: How = How {
        write: true,
        create: true,
        exclusive: false,
        direct: false,
    };
}

/// The store's directory, open (module docs).
#[derive(Debug)]
pub(super) struct StoreDir {
    fd: OwnedFd,
    path: PathBuf,
    /// The effective user every file must belong to.
    uid: u32,
}

/// The process's effective user id.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn untrusted(path: &Path, why: impl std::fmt::Display) -> Error {
    storage(path, StorageFailure::Untrusted, why)
}

/// Full disk or quota: [`StorageFailure::Full`]; anything else `otherwise`.
fn failure_of(e: Errno, otherwise: StorageFailure) -> StorageFailure {
    match e {
        Errno::NOSPC | Errno::DQUOT => StorageFailure::Full,
        _ => otherwise,
    }
}

impl StoreDir {
    /// Opens directory `path`, creating it (and its missing parents, mode 0700) when `create`.
    /// Errors: [`StorageFailure::Open`] (it cannot be made or opened: absent when not created,
    /// a file in the way), [`StorageFailure::Untrusted`] (a symbolic link, another user's, or
    /// writable by group or others).
    pub fn open(path: &Path, create: bool) -> Result<Self> {
        if create {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|e| storage(path, StorageFailure::Open, e))?;
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(|e| {
            let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            if link || e == Errno::LOOP {
                untrusted(path, "the store's directory is a symbolic link")
            } else {
                storage(path, StorageFailure::Open, std::io::Error::from(e))
            }
        })?;
        let dir = Self {
            fd,
            path: path.to_path_buf(),
            uid: euid(),
        };
        dir.trust(dir.fd.as_fd(), path, FileType::Directory)?;
        Ok(dir)
    }

    /// The directory's path (what errors name).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of entry `name` (what errors name).
    pub fn file_path(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Refuses (as [`StorageFailure::Untrusted`]) an open file or directory that someone else
    /// could change: another kind than `kind`, another owner, writable by group or others, or
    /// (a file) more than one hard link.
    fn trust(&self, fd: BorrowedFd<'_>, path: &Path, kind: FileType) -> Result<()> {
        let st = rustix::fs::fstat(fd).map_err(|e| storage(path, StorageFailure::Io, e))?;
        let found = FileType::from_raw_mode(st.st_mode);
        if found != kind {
            return Err(untrusted(
                path,
                format!("a {found:?} where a {kind:?} belongs"),
            ));
        }
        if st.st_uid != self.uid {
            return Err(untrusted(
                path,
                format!(
                    "owned by user {}, not by this process's user {}",
                    st.st_uid, self.uid
                ),
            ));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(untrusted(
                path,
                format!(
                    "writable by group or others (mode {:o}): chmod go-w",
                    st.st_mode & 0o7777
                ),
            ));
        }
        if kind == FileType::RegularFile && st.st_nlink != 1 {
            return Err(untrusted(
                path,
                format!("{} hard links to it (one expected)", st.st_nlink),
            ));
        }
        Ok(())
    }

    /// Opens file `name` of the directory as `how` says, never following a link (module docs),
    /// and checks it is a file only this user can change. `None`: absent (and not created).
    pub fn open_file(&self, name: &str, how: How) -> Result<Option<File>> {
        let path = self.file_path(name);
        let mut flags = OFlags::CLOEXEC | OFlags::NOFOLLOW;
        flags |= if how.write {
            OFlags::RDWR
        } else {
            OFlags::RDONLY
        };
        if how.create || how.exclusive {
            flags |= OFlags::CREATE;
        }
        if how.exclusive {
            flags |= OFlags::EXCL;
        }
        if how.direct {
            flags |= OFlags::DIRECT;
        }
        // openat2 refuses a mode unless it creates.
        let mode = match flags.contains(OFlags::CREATE) {
            true => Mode::from_raw_mode(0o600),
            false => Mode::empty(),
        };
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        let opened = match rustix::fs::openat2(&self.fd, name, flags, mode, resolve) {
            // No openat2 here (an old kernel, or a seccomp filter): the name is one component,
            // so O_NOFOLLOW from the directory's descriptor refuses the same links.
            Err(Errno::NOSYS | Errno::PERM | Errno::TOOBIG) => {
                rustix::fs::openat(&self.fd, name, flags, mode)
            }
            other => other,
        };
        let fd = match opened {
            Ok(fd) => fd,
            Err(Errno::NOENT) if !(how.create || how.exclusive) => return Ok(None),
            Err(Errno::LOOP | Errno::XDEV) => {
                return Err(untrusted(
                    &path,
                    "a symbolic link (refused, never followed)",
                ))
            }
            Err(Errno::INVAL) if how.direct => {
                return Err(storage(
                    &path,
                    StorageFailure::Open,
                    "the filesystem refuses O_DIRECT",
                ))
            }
            Err(e) => {
                return Err(storage(
                    &path,
                    failure_of(e, StorageFailure::Open),
                    std::io::Error::from(e),
                ))
            }
        };
        self.trust(fd.as_fd(), &path, FileType::RegularFile)?;
        Ok(Some(File::from(fd)))
    }

    /// Removes entry `name` (the entry itself, a link never followed); absent is fine.
    pub fn remove(&self, name: &str) -> Result<()> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(storage(
                &self.file_path(name),
                StorageFailure::Io,
                std::io::Error::from(e),
            )),
        }
    }

    /// Renames entry `from` over entry `to`, both in the directory.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        rustix::fs::renameat(&self.fd, from, &self.fd, to).map_err(|e| {
            storage(
                &self.file_path(to),
                failure_of(e, StorageFailure::Io),
                std::io::Error::from(e),
            )
        })
    }

    /// Makes the directory's entries durable (a new file's name, a rename).
    pub fn sync(&self) -> Result<()> {
        rustix::fs::fsync(&self.fd).map_err(|e| storage(&self.path, StorageFailure::Io, e))
    }

    /// Bytes the filesystem has free for this user.
    pub fn free_bytes(&self) -> Result<u64> {
        let vfs = rustix::fs::fstatvfs(&self.fd)
            .map_err(|e| storage(&self.path, StorageFailure::Io, e))?;
        Ok(vfs.f_bavail.saturating_mul(vfs.f_frsize))
    }

    /// The (device, inode) entry `name` names now, a link not followed; `None` when absent.
    pub fn identity(&self, name: &str) -> Result<Option<(u64, u64)>> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((st.st_dev, st.st_ino))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(storage(&self.file_path(name), StorageFailure::Io, e)),
        }
    }

    /// Takes writer rank `writer`'s lock (module docs), held while the returned value lives.
    /// Another holder: [`StorageFailure::Locked`] with its process id.
    pub fn lock_writer(&self, writer: u32) -> Result<WriterLock> {
        let name = format!("w{writer:04}.lock");
        let path = self.file_path(&name);
        let file = self
            .open_file(&name, How::WRITE)?
            .ok_or_else(|| storage(&path, StorageFailure::Open, "not created"))?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => {
                let mut said = [0u8; 24];
                let n = file.read_at(&mut said, 0).unwrap_or(0);
                let holder = std::str::from_utf8(&said[..n])
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                return Err(storage(
                    &path,
                    StorageFailure::Locked { holder },
                    format!(
                        "writer {writer} of this directory is open elsewhere{}: one writer per directory and rank (open read-only to read alongside it)",
                        holder.map_or(String::new(), |p| format!(" (process {p})"))
                    ),
                ));
            }
            Err(e) => return Err(storage(&path, StorageFailure::Io, e)),
        }
        let pid = format!("{}\n", std::process::id());
        file.set_len(0)
            .and_then(|()| file.write_all_at(pid.as_bytes(), 0))
            .map_err(|e| storage(&path, StorageFailure::Io, e))?;
        Ok(WriterLock { _file: file })
    }
}

/// A writer rank's lock (released when dropped: the kernel drops an `flock` with its last
/// descriptor).
#[derive(Debug)]
pub(super) struct WriterLock {
    _file: File,
}
