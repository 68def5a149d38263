//! Host shared memory: the CPU twin of exportable device memory.
//!
//! A memfd (`memfd_create`) sized with `ftruncate`, sealed so its size can never change again,
//! and mapped `MAP_SHARED`. Another process maps the same pages from the descriptor
//! ([`SharedMemory::from_fd`]), which travels over the control channel like a CUDA VMM
//! descriptor does.
//!
//! The seals matter: a mapping of a file that someone later shrinks raises `SIGBUS` on access, so
//! an importer refuses a descriptor that is not sealed against shrinking.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{FileType, MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

fn os(call: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |errno| Error::Os {
        call,
        source: errno.into(),
    }
}

/// A shared, read-write mapping of a sealed memfd, unmapped on drop.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; this process reaches it only through
// bounds-checked copies or through the unsafe slice views, whose callers take on the aliasing
// rules.
unsafe impl Send for SharedMemory {}
// SAFETY: see Send; no method of `&self` hands out a reference into the mapping safely.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates `len` bytes (at least one) of zeroed shared memory; `name` only labels it (in
    /// `/proc/<pid>/fd`).
    pub fn create(name: &str, len: usize) -> Result<Self> {
        check_len(len)?;
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(os("fcntl(F_ADD_SEALS)"))?;
        Self::map(fd, len)
    }

    /// Maps shared memory another process created and sent as `fd`, which must be a memfd of
    /// exactly `len` bytes sealed against shrinking.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self> {
        check_len(len)?;
        let stat = rustix::fs::fstat(&fd).map_err(os("fstat"))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(Error::InvalidArgument(
                "shared memory descriptor is not a memory file".into(),
            ));
        }
        if u64::try_from(stat.st_size).ok() != Some(len as u64) {
            return Err(Error::InvalidArgument(format!(
                "shared memory descriptor holds {} bytes, {len} expected",
                stat.st_size
            )));
        }
        // A file that cannot carry seals (not a memfd) answers EINVAL: it has none.
        let seals = match rustix::fs::fcntl_get_seals(&fd) {
            Err(rustix::io::Errno::INVAL) => SealFlags::empty(),
            other => other.map_err(os("fcntl(F_GET_SEALS)"))?,
        };
        if !seals.contains(SealFlags::SHRINK) {
            return Err(Error::InvalidArgument(
                "shared memory descriptor is not sealed against shrinking (its creator could \
                 truncate it under the mapping)"
                    .into(),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no fixed address, so nothing of
        // ours is replaced); `len` matches the sealed file size, so every mapped page is backed.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(os("mmap"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(Error::Os {
            call: "mmap",
            source: std::io::Error::other("mapped at address 0"),
        })?;
        Ok(Self { fd, ptr, len })
    }

    /// A path another process of this user can open, while this one lives, to map the same
    /// memory with [`SharedMemory::open`] (the memfd through `/proc/<pid>/fd`): how a parent
    /// hands shared memory to the processes it starts without passing descriptors.
    pub fn proc_path(&self) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd()).into()
    }

    /// Maps the shared memory at `path` (a [`proc_path`](Self::proc_path) of its creator),
    /// which must hold exactly `len` bytes sealed against shrinking, as [`from_fd`](Self::from_fd)
    /// checks.
    pub fn open(path: &std::path::Path, len: usize) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| Error::Os {
                call: "open shared memory",
                source,
            })?;
        Self::from_fd(OwnedFd::from(file), len)
    }

    /// A new descriptor of the same memory, to send to another process.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|source| Error::Os {
            call: "fcntl(F_DUPFD_CLOEXEC)",
            source,
        })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping holds at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// First byte of the mapping in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `buf.len()` bytes at `offset` out of the mapping.
    ///
    /// Bytes another process writes meanwhile may be seen torn; ordering is the protocol's job
    /// (read after the `Chunk` status that covers them).
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len())?;
        // SAFETY: the range lies inside the live mapping (checked above) and `buf` is a distinct
        // local buffer, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// Copies `data` into the mapping at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        // SAFETY: the range lies inside the live, writable mapping; `data` is not part of it
        // (no safe reference into the mapping exists).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// The mapping as a slice.
    ///
    /// # Safety
    /// Nothing may write to the memory while the slice lives: not this process (through
    /// [`write_at`](Self::write_at) or another mapping) and not any process it was shared with.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` bytes long; the caller rules out writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The mapping as a mutable slice.
    ///
    /// # Safety
    /// Nothing else may read or write the memory while the slice lives, in this process or any
    /// process it was shared with.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live, writable and `len` bytes long; the caller rules out
        // every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                what: "shared memory range end",
                index: i64::try_from(offset.saturating_add(len)).unwrap_or(i64::MAX),
                limit: self.len as u64 + 1,
            }),
        }
    }
}

impl AsFd for SharedMemory {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this address and length and is unmapped
        // once; no reference into it outlives `self` (the slice views borrow `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn check_len(len: usize) -> Result<()> {
    if len == 0 || len > isize::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "shared memory of {len} bytes: must be 1..=isize::MAX"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_sees_the_same_bytes() {
        let a = SharedMemory::create("kvshard-test", 4096 + 17).unwrap();
        let b = SharedMemory::from_fd(a.export_fd().unwrap(), a.len()).unwrap();
        a.write_at(4000, b"0123456789abcdef").unwrap();
        let mut out = [0u8; 16];
        b.read_at(4000, &mut out).unwrap();
        assert_eq!(&out, b"0123456789abcdef");
        assert_ne!(a.as_ptr(), b.as_ptr());
    }

    #[test]
    fn sizes_and_ranges_are_checked() {
        assert!(matches!(
            SharedMemory::create("x", 0),
            Err(Error::InvalidArgument(_))
        ));
        let a = SharedMemory::create("x", 100).unwrap();
        assert!(matches!(
            SharedMemory::from_fd(a.export_fd().unwrap(), 101),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            a.write_at(90, &[1; 11]),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            a.read_at(usize::MAX, &mut [0; 2]),
            Err(Error::OutOfRange { .. })
        ));
        a.write_at(90, &[1; 10]).unwrap();
    }

    #[test]
    fn unsealed_or_foreign_descriptors_are_refused() {
        let unsealed =
            rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&unsealed, 64).unwrap();
        assert!(matches!(
            SharedMemory::from_fd(unsealed, 64),
            Err(Error::InvalidArgument(_))
        ));
        let (sock, _other) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(matches!(
            SharedMemory::from_fd(sock.into(), 64),
            Err(Error::InvalidArgument(_))
        ));
    }
}
