//! The control channel: framed [`Message`]s with attached file descriptors over a Unix-domain
//! stream socket, a handshake, heartbeats and bounded-time detection of a gone peer.
//!
//! The decode process binds a [`Listener`] and accepts one [`Channel`] per prefill process
//! ([`Listener::accept_n`]); each prefill process calls [`Channel::connect`], which retries until
//! the socket appears. [`Channel::recv_timeout`] serves one peer, [`recv_any`] several. The wire
//! format is in [`super::wire`] and the module docs of [`super`].

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::wire::{self, Header, Hello, Message, ProtocolError, HEADER_BYTES, MAX_FDS};
use crate::error::{Error, Result};
use crate::lock::lock;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 64 * 1024;
/// Pause between connection attempts while the listener's socket does not exist yet.
const CONNECT_RETRY: Duration = Duration::from_millis(20);
/// Why a peer that said `Bye` is gone.
const SAID_BYE: &str = "said Bye";
/// Control-message space for the most descriptors one frame may carry.
const CMSG_SPACE: usize = rustix::cmsg_space!(ScmRights(MAX_FDS));

/// How often a channel proves it is alive, and how long a silent peer is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Interval between heartbeats this side sends.
    pub heartbeat: Duration,
    /// A peer silent this long is gone; also the limit for a send the peer does not drain and
    /// for the handshake's answer.
    pub timeout: Duration,
}

impl Default for Liveness {
    /// Heartbeat every 100 ms, gone after 750 ms of silence: a stopped or hung peer is reported
    /// within a second, and a few lost scheduling slices do not trip it.
    fn default() -> Self {
        Liveness {
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_millis(750),
        }
    }
}

impl Liveness {
    fn check(&self) -> Result<()> {
        let twice = self.heartbeat.checked_mul(2);
        if self.heartbeat.is_zero() || twice.is_none_or(|twice| self.timeout < twice) {
            return Err(Error::InvalidArgument(format!(
                "liveness: heartbeat {:?} must be non-zero and at most half the timeout {:?}",
                self.heartbeat, self.timeout
            )));
        }
        Ok(())
    }
}

/// A message and the file descriptors that came with it (in the order they were attached).
#[derive(Debug)]
pub struct Received {
    /// The message.
    pub message: Message,
    /// Its descriptors; closed when dropped unless taken.
    pub fds: Vec<OwnedFd>,
}

/// What the caller's thread and the heartbeat thread share.
#[derive(Debug)]
struct Shared {
    stream: UnixStream,
    /// Held for a whole frame, so frames from the two threads never interleave.
    write: Mutex<()>,
    stop: Mutex<bool>,
    wake: Condvar,
    /// Why a send failed (either thread); the connection is unusable from then on.
    send_failed: Mutex<Option<String>>,
}

/// Writes one whole frame, descriptors attached to its first bytes.
fn write_frame(shared: &Shared, frame: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let _frame = lock(&shared.write);
    let mut space = [MaybeUninit::<u8>::uninit(); CMSG_SPACE];
    let mut sent = 0;
    while sent < frame.len() {
        let iov = [IoSlice::new(&frame[sent..])];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if sent == 0 && !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(std::io::Error::other(format!(
                "{} descriptors do not fit one control message",
                fds.len()
            )));
        }
        // NOSIGNAL: a closed peer must be an error here, not a SIGPIPE that kills an engine that
        // never set SIGPIPE to ignore.
        match rustix::net::sendmsg(&shared.stream, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn send_failure(e: &std::io::Error, timeout: Duration) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("not reading: a send stayed blocked for {timeout:?}")
        }
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::NotConnected => format!("connection closed while sending ({e})"),
        _ => format!("send failed: {e}"),
    }
}

fn heartbeat_loop(shared: Arc<Shared>, liveness: Liveness, frame: Vec<u8>) {
    let mut stop = lock(&shared.stop);
    loop {
        // `_while` checks the flag before it sleeps: a stop set while this thread was sending
        // ends it at once instead of one interval later.
        stop = match shared
            .wake
            .wait_timeout_while(stop, liveness.heartbeat, |stop| !*stop)
        {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        };
        if *stop {
            return;
        }
        drop(stop);
        if let Err(e) = write_frame(&shared, &frame, &[]) {
            *lock(&shared.send_failed) = Some(send_failure(&e, liveness.timeout));
            return;
        }
        stop = lock(&shared.stop);
    }
}

/// The receive side of a connection: buffered bytes and descriptors, and how it ended.
#[derive(Debug)]
struct Link {
    shared: Arc<Shared>,
    /// The peer's rank once its Hello has arrived.
    rank: Option<u32>,
    rx: Vec<u8>,
    rx_fds: VecDeque<OwnedFd>,
    last_heard: Instant,
    /// An error to report once (a protocol violation found while reading), then `broken`.
    pending: Option<Error>,
    /// Why the connection is unusable both ways (violation, silence, failed send, reset).
    broken: Option<String>,
    /// Why the peer will send nothing more (its `Bye`, or the end of the stream); sending may
    /// still work (the peer may be reading until it closes).
    finished: Option<String>,
}

impl Link {
    fn new(stream: UnixStream) -> Self {
        Link {
            shared: Arc::new(Shared {
                stream,
                write: Mutex::new(()),
                stop: Mutex::new(false),
                wake: Condvar::new(),
                send_failed: Mutex::new(None),
            }),
            rank: None,
            rx: Vec::new(),
            rx_fds: VecDeque::new(),
            last_heard: Instant::now(),
            pending: None,
            broken: None,
            finished: None,
        }
    }

    fn gone_error(&self, why: &str) -> Error {
        Error::PeerGone {
            rank: self.rank,
            why: why.to_string(),
        }
    }

    /// Marks the connection unusable and shuts the socket down (the peer sees the end at once).
    fn break_off(&mut self, why: String) -> Error {
        let _ = self.shared.stream.shutdown(std::net::Shutdown::Both);
        let e = self.gone_error(&why);
        self.broken = Some(why);
        e
    }

    /// Drops the connection for a protocol violation (the stream cannot be resynchronized, so
    /// what is buffered goes too): the error to report now; later calls report the peer gone.
    fn violation(&mut self, violation: ProtocolError) -> Error {
        self.break_off(format!(
            "connection dropped after a protocol violation: {violation}"
        ));
        self.rx.clear();
        self.rx_fds.clear();
        Error::Protocol {
            rank: self.rank,
            violation,
        }
    }

    fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<()> {
        let failed = lock(&self.shared.send_failed).clone();
        if let Some(why) = self.broken.clone().or(failed) {
            return Err(self.gone_error(&why));
        }
        let frame = wire::encode(msg, fds.len())
            .map_err(|e| Error::InvalidArgument(format!("cannot send {}: {e}", msg.name())))?;
        if let Err(e) = write_frame(&self.shared, &frame, fds) {
            // Part of the frame may have gone out: the stream cannot be resynchronized.
            return Err(self.break_off(send_failure(&e, timeout)));
        }
        Ok(())
    }

    /// Reads what the socket has (without blocking) into the buffers.
    fn fill(&mut self) {
        if self.broken.is_some() || self.finished.is_some() {
            return;
        }
        // Never buffer past the frame being read plus one chunk.
        let start = self.rx.len();
        self.rx.resize(start + READ_CHUNK, 0);
        let mut space = [MaybeUninit::<u8>::uninit(); CMSG_SPACE];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let result = rustix::net::recvmsg(
            &self.shared.stream,
            &mut [IoSliceMut::new(&mut self.rx[start..])],
            &mut control,
            RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
        );
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                self.rx_fds.extend(fds);
            }
        }
        match result {
            Ok(r) => {
                self.rx.truncate(start + r.bytes);
                if r.flags.contains(ReturnFlags::CTRUNC) {
                    let e = self.violation(ProtocolError::TooManyFds {
                        count: MAX_FDS + 1,
                        limit: MAX_FDS,
                    });
                    self.pending = Some(e);
                } else if self.rx_fds.len() > 2 * MAX_FDS {
                    // Descriptors no frame header accounts for.
                    let e = self.violation(ProtocolError::TooManyFds {
                        count: self.rx_fds.len(),
                        limit: 2 * MAX_FDS,
                    });
                    self.pending = Some(e);
                } else if r.bytes == 0 {
                    self.finished = Some("closed the connection (end of stream)".into());
                } else {
                    self.last_heard = Instant::now();
                }
            }
            Err(e) => {
                self.rx.truncate(start);
                match e {
                    Errno::AGAIN | Errno::INTR => {}
                    Errno::CONNRESET => {
                        self.break_off("connection reset".into());
                    }
                    e => {
                        self.break_off(format!("recvmsg failed: {e}"));
                    }
                }
            }
        }
    }

    /// Takes one complete frame out of the buffers, if there is one.
    fn take_frame(&mut self) -> std::result::Result<Option<Received>, ProtocolError> {
        let Some(head) = self.rx.first_chunk::<HEADER_BYTES>() else {
            return Ok(None);
        };
        let header = Header::decode(head)?;
        let end = HEADER_BYTES + header.payload as usize;
        if self.rx.len() < end {
            return Ok(None);
        }
        // Descriptors arrive with the first bytes of their frame, so every earlier frame's are
        // already taken and this one's are at the front.
        let count = usize::from(header.fds);
        if self.rx_fds.len() < count {
            return Err(ProtocolError::FdCount {
                what: "frame header",
                expected: count,
                got: self.rx_fds.len(),
            });
        }
        let fds: Vec<OwnedFd> = self.rx_fds.drain(..count).collect();
        let message = wire::decode(&self.rx[HEADER_BYTES..end], fds.len())?;
        self.rx.drain(..end);
        Ok(Some(Received { message, fds }))
    }

    /// The next buffered message, heartbeats consumed; frames buffered before the end of the
    /// stream are still delivered, nothing after a `Bye`.
    fn next_frame(&mut self) -> Result<Option<Received>> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        if let Some(why) = self.broken.clone() {
            return Err(self.gone_error(&why));
        }
        if self.finished.as_deref() == Some(SAID_BYE) {
            return Err(self.gone_error(SAID_BYE));
        }
        loop {
            match self.take_frame() {
                Ok(Some(Received {
                    message: Message::Heartbeat,
                    ..
                })) => continue,
                Ok(Some(r)) => {
                    if r.message == Message::Bye {
                        self.finished = Some(SAID_BYE.into());
                    }
                    return Ok(Some(r));
                }
                Ok(None) => return Ok(None),
                Err(violation) => return Err(self.violation(violation)),
            }
        }
    }

    /// The next message, or why the peer is gone; never blocks. `silence` is the liveness limit
    /// (none during the handshake, which has its own deadline).
    fn ready(&mut self, silence: Option<Duration>) -> Result<Option<Received>> {
        if let Some(r) = self.next_frame()? {
            return Ok(Some(r));
        }
        if let Some(why) = self.finished.clone() {
            return Err(self.gone_error(&why));
        }
        let send_failed = lock(&self.shared.send_failed).clone();
        if let Some(why) = send_failed {
            return Err(self.break_off(why));
        }
        let Some(limit) = silence else {
            return Ok(None);
        };
        if self.last_heard.elapsed() < limit {
            return Ok(None);
        }
        // The caller may not have read this socket for a while (it served other peers): the
        // peer is silent only if nothing is waiting in the socket either.
        self.fill();
        if let Some(r) = self.next_frame()? {
            return Ok(Some(r));
        }
        if let Some(why) = self.finished.clone() {
            return Err(self.gone_error(&why));
        }
        let silent = self.last_heard.elapsed();
        if silent < limit {
            return Ok(None);
        }
        Err(self.break_off(format!(
            "silent for {silent:.2?} (liveness timeout {limit:?})"
        )))
    }

    /// How long a wait may last before the liveness limit needs checking again.
    fn until_silent(&self, silence: Option<Duration>) -> Option<Duration> {
        silence.map(|limit| limit.saturating_sub(self.last_heard.elapsed()))
    }

    /// Blocks until a message, the peer's end, or `deadline` (`Ok(None)`).
    fn recv_until(
        &mut self,
        deadline: Instant,
        silence: Option<Duration>,
    ) -> Result<Option<Received>> {
        loop {
            if let Some(r) = self.ready(silence)? {
                return Ok(Some(r));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let mut wait = deadline - now;
            if let Some(left) = self.until_silent(silence) {
                wait = wait.min(left);
            }
            let readable = {
                let mut fds = [PollFd::new(&self.shared.stream, PollFlags::IN)];
                poll(&mut fds, wait)?;
                !fds[0].revents().is_empty()
            };
            if readable {
                self.fill();
            }
        }
    }
}

/// `poll(2)` for at most `wait`, retried on EINTR (the caller re-checks its own deadline).
fn poll(fds: &mut [PollFd<'_>], wait: Duration) -> Result<usize> {
    // Rounded up to whole milliseconds so a sub-millisecond remainder does not spin.
    let wait =
        Duration::from_millis(u64::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u64::MAX));
    let timeout = rustix::event::Timespec::try_from(wait).ok();
    match rustix::event::poll(fds, timeout.as_ref()) {
        Ok(n) => Ok(n),
        Err(Errno::INTR) => Ok(0),
        Err(errno) => Err(Error::Os {
            call: "poll",
            source: errno.into(),
        }),
    }
}

fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    // A timeout too large for the clock means "no deadline" in practice: a century will do.
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// One end of a control connection, past the handshake.
///
/// Dropping it stops its heartbeat thread and shuts the socket down, which the peer sees at once
/// as the end of the stream; [`Channel::bye`] says goodbye first.
#[derive(Debug)]
pub struct Channel {
    link: Link,
    local: Hello,
    peer: Hello,
    liveness: Liveness,
    heartbeat: Option<JoinHandle<()>>,
}

impl Channel {
    /// Connects to the listener at `path`, retrying while the socket does not exist or refuses
    /// (the decode process may still be starting), then shakes hands; both within `wait`.
    pub fn connect(
        path: impl AsRef<Path>,
        local: Hello,
        liveness: Liveness,
        wait: Duration,
    ) -> Result<Channel> {
        liveness.check()?;
        let path = path.as_ref();
        let start = Instant::now();
        let deadline = deadline_after(wait);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(stream) => break stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::Timeout {
                            what: format!("connecting to {} ({e})", path.display()),
                            waited: start.elapsed(),
                        });
                    }
                    std::thread::sleep(CONNECT_RETRY.min(deadline - now));
                }
                Err(source) => {
                    return Err(Error::Os {
                        call: "connect",
                        source,
                    })
                }
            }
        };
        let left = deadline.saturating_duration_since(Instant::now());
        Channel::handshake(stream, local, liveness, left.max(liveness.timeout))
    }

    /// Shakes hands over a connected stream (from [`UnixStream::pair`], say): sends `local`,
    /// waits up to `timeout` for the peer's `Hello` and checks its version, then starts the
    /// heartbeat thread.
    pub fn handshake(
        stream: UnixStream,
        local: Hello,
        liveness: Liveness,
        timeout: Duration,
    ) -> Result<Channel> {
        liveness.check()?;
        let os = |call| move |source| Error::Os { call, source };
        stream
            .set_nonblocking(false)
            .map_err(os("fcntl(O_NONBLOCK)"))?;
        // Sends block until the peer drains them, but never longer than the liveness timeout.
        stream
            .set_write_timeout(Some(liveness.timeout))
            .map_err(os("setsockopt(SO_SNDTIMEO)"))?;
        let mut link = Link::new(stream);
        link.send(&Message::Hello(local.clone()), &[], liveness.timeout)?;
        let start = Instant::now();
        let peer = match link.recv_until(deadline_after(timeout), None)? {
            Some(Received {
                message: Message::Hello(peer),
                ..
            }) => peer,
            Some(other) => {
                let violation = ProtocolError::Unexpected {
                    expected: "Hello",
                    got: other.message.name(),
                };
                let _ = link.shared.stream.shutdown(std::net::Shutdown::Both);
                return Err(Error::Protocol {
                    rank: None,
                    violation,
                });
            }
            None => {
                return Err(Error::Timeout {
                    what: "the peer's Hello".into(),
                    waited: start.elapsed(),
                })
            }
        };
        if peer.version != wire::VERSION {
            let _ = link.shared.stream.shutdown(std::net::Shutdown::Both);
            return Err(Error::Protocol {
                rank: Some(peer.rank),
                violation: ProtocolError::Version {
                    ours: wire::VERSION,
                    theirs: peer.version,
                },
            });
        }
        link.rank = Some(peer.rank);
        link.last_heard = Instant::now();
        let frame = wire::encode(&Message::Heartbeat, 0)
            .map_err(|e| Error::InvalidArgument(format!("heartbeat frame: {e}")))?;
        let shared = link.shared.clone();
        let heartbeat = std::thread::Builder::new()
            .name(format!("kvshard-heartbeat-{}", peer.rank))
            .spawn(move || heartbeat_loop(shared, liveness, frame))
            .map_err(os("spawn heartbeat thread"))?;
        Ok(Channel {
            link,
            local,
            peer,
            liveness,
            heartbeat: Some(heartbeat),
        })
    }

    /// The peer's `Hello`.
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// This side's `Hello`.
    pub fn local(&self) -> &Hello {
        &self.local
    }

    /// The liveness settings.
    pub fn liveness(&self) -> Liveness {
        self.liveness
    }

    /// Sends a message that carries no descriptors.
    pub fn send(&mut self, msg: &Message) -> Result<()> {
        self.send_with_fds(msg, &[])
    }

    /// Sends a message with descriptors attached (as many as [`Message::fds_needed`] says; the
    /// peer receives duplicates, these stay open here).
    pub fn send_with_fds(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.link.send(msg, fds, self.liveness.timeout)
    }

    /// Waits up to `timeout` for the next message (`Ok(None)` when none came and the peer is
    /// alive). Heartbeats are consumed here; a `Bye` is returned, and every call after it
    /// reports the peer gone.
    ///
    /// # Errors
    /// [`Error::PeerGone`] once the peer closed the connection, was killed, or has been silent
    /// for [`Liveness::timeout`]; [`Error::Protocol`] (once, then `PeerGone`) for a frame the
    /// protocol refuses.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Received>> {
        self.link
            .recv_until(deadline_after(timeout), Some(self.liveness.timeout))
    }

    /// Says goodbye (a `Bye` the peer receives as a message) and closes the connection.
    pub fn bye(mut self) -> Result<()> {
        self.send(&Message::Bye)
    }
}

impl AsFd for Channel {
    /// The socket, to wait on it in the caller's own poll loop (then call
    /// [`Channel::recv_timeout`] with a zero timeout).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.link.shared.stream.as_fd()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        *lock(&self.link.shared.stop) = true;
        self.link.shared.wake.notify_all();
        // Unblocks a heartbeat stuck in a send, and tells the peer at once.
        let _ = self.link.shared.stream.shutdown(std::net::Shutdown::Both);
        if let Some(thread) = self.heartbeat.take() {
            let _ = thread.join();
        }
    }
}

/// Waits up to `timeout` for a message on any of `channels`: `Ok(Some((i, result)))` for the
/// first channel (in slice order) with a message or an error, `Ok(None)` when the time passed
/// quietly.
///
/// A channel whose result is an error is finished: remove it before the next call, or it
/// reports the same error again. The outer error is a failure of `poll(2)` itself.
pub fn recv_any(
    channels: &mut [Channel],
    timeout: Duration,
) -> Result<Option<(usize, Result<Received>)>> {
    let deadline = deadline_after(timeout);
    loop {
        for (i, ch) in channels.iter_mut().enumerate() {
            match ch.link.ready(Some(ch.liveness.timeout)) {
                Ok(None) => {}
                Ok(Some(r)) => return Ok(Some((i, Ok(r)))),
                Err(e) => return Ok(Some((i, Err(e)))),
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        let wait = channels
            .iter()
            .filter_map(|ch| ch.link.until_silent(Some(ch.liveness.timeout)))
            .fold(deadline - now, Duration::min);
        let readable: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = channels
                .iter()
                .map(|ch| PollFd::new(&ch.link.shared.stream, PollFlags::IN))
                .collect();
            poll(&mut fds, wait)?;
            fds.iter().map(|fd| !fd.revents().is_empty()).collect()
        };
        for (ch, readable) in channels.iter_mut().zip(readable) {
            if readable {
                ch.link.fill();
            }
        }
    }
}

/// The decode side's listening socket; removes its socket file on drop.
#[derive(Debug)]
pub struct Listener {
    inner: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file this listener created, so drop removes only that.
    file: (u64, u64),
    local: Hello,
    liveness: Liveness,
}

impl Listener {
    /// Listens at `path`. A stale socket file there (left by a process that died, nobody
    /// accepting) is replaced; a live one is an error.
    pub fn bind(path: impl AsRef<Path>, local: Hello, liveness: Liveness) -> Result<Listener> {
        liveness.check()?;
        let path = path.as_ref().to_path_buf();
        let os = |call| move |source| Error::Os { call, source };
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            let stale = meta.file_type().is_socket()
                && UnixStream::connect(&path)
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused);
            if !stale {
                return Err(Error::Os {
                    call: "bind",
                    source: std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        format!("{} exists and is not a stale socket", path.display()),
                    ),
                });
            }
            std::fs::remove_file(&path).map_err(os("unlink stale socket"))?;
        }
        let inner = UnixListener::bind(&path).map_err(os("bind"))?;
        inner
            .set_nonblocking(true)
            .map_err(os("fcntl(O_NONBLOCK)"))?;
        let meta = std::fs::symlink_metadata(&path).map_err(os("stat"))?;
        Ok(Listener {
            inner,
            file: (meta.dev(), meta.ino()),
            path,
            local,
            liveness,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits up to `timeout` for one connection and shakes hands with it (the handshake has
    /// [`Liveness::timeout`] of its own). `Ok(None)`: nobody connected in time. An error concerns
    /// that one connection only; the listener stays usable.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Option<Channel>> {
        let deadline = deadline_after(timeout);
        loop {
            match self.inner.accept() {
                Ok((stream, _)) => {
                    return Channel::handshake(
                        stream,
                        self.local.clone(),
                        self.liveness,
                        self.liveness.timeout,
                    )
                    .map(Some)
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Os {
                        call: "accept",
                        source,
                    })
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            poll(
                &mut [PollFd::new(&self.inner, PollFlags::IN)],
                deadline - now,
            )?;
        }
    }

    /// Accepts connections until `n` have shaken hands, within `timeout` in all. Connections
    /// whose handshake fails are dropped and named in the timeout error if `n` is not reached.
    pub fn accept_n(&self, n: usize, timeout: Duration) -> Result<Vec<Channel>> {
        let start = Instant::now();
        let deadline = deadline_after(timeout);
        let mut channels = Vec::with_capacity(n.min(1024));
        let mut failures = Vec::new();
        while channels.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.accept_timeout(left) {
                Ok(Some(ch)) => channels.push(ch),
                Ok(None) => {
                    let failed = if failures.is_empty() {
                        String::new()
                    } else {
                        format!("; refused: {}", failures.join("; "))
                    };
                    return Err(Error::Timeout {
                        what: format!(
                            "{} of {n} peers connected to {}{failed}",
                            channels.len(),
                            self.path.display()
                        ),
                        waited: start.elapsed(),
                    });
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
        Ok(channels)
    }
}

impl AsFd for Listener {
    /// The listening socket, to wait on it in the caller's own poll loop.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::wire::Role;
    use std::io::Write;

    fn pair_with(live: Liveness) -> (Channel, Channel) {
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            Channel::handshake(
                b,
                Hello::new(Role::Prefill, 1, 2),
                live,
                Duration::from_secs(5),
            )
        });
        let a = Channel::handshake(
            a,
            Hello::new(Role::Decode, 0, 1),
            live,
            Duration::from_secs(5),
        )
        .unwrap();
        (a, t.join().unwrap().unwrap())
    }

    #[test]
    fn handshake_exchanges_hellos_and_heartbeats_keep_it_alive() {
        // A timeout long enough that a loaded test machine's scheduling never trips it: what is
        // tested is that heartbeats alone keep a quiet link alive past it.
        let (mut a, mut b) = pair_with(Liveness {
            heartbeat: Duration::from_millis(50),
            timeout: Duration::from_millis(1500),
        });
        assert_eq!(a.peer().rank, 1);
        assert_eq!(b.peer().role, Role::Decode);
        // Two liveness timeouts of nothing but heartbeats: still alive, nothing delivered.
        assert!(a
            .recv_timeout(Duration::from_millis(3200))
            .unwrap()
            .is_none());
        b.send(&Message::Abort {
            request: 5,
            reason: "test".into(),
        })
        .unwrap();
        let got = a.recv_timeout(Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(got.message.name(), "Abort");
        b.bye().unwrap();
        assert_eq!(
            a.recv_timeout(Duration::from_secs(1))
                .unwrap()
                .unwrap()
                .message,
            Message::Bye
        );
        assert!(matches!(
            a.recv_timeout(Duration::from_secs(1)),
            Err(Error::PeerGone { rank: Some(1), .. })
        ));
    }

    #[test]
    fn a_silent_peer_is_gone_after_the_timeout() {
        let (a, mut raw) = UnixStream::pair().unwrap();
        let hello = wire::encode(&Message::Hello(Hello::new(Role::Prefill, 4, 8)), 0).unwrap();
        raw.write_all(&hello).unwrap();
        let mut ch = Channel::handshake(
            a,
            Hello::new(Role::Decode, 0, 1),
            Liveness::default(),
            Duration::from_secs(1),
        )
        .unwrap();
        let start = Instant::now();
        let err = ch.recv_timeout(Duration::from_secs(5)).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(err, Error::PeerGone { rank: Some(4), .. }),
            "{err}"
        );
        assert!(took < Duration::from_millis(1000), "{took:?}");
    }

    #[test]
    fn bad_liveness_is_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let live = Liveness {
            heartbeat: Duration::from_millis(500),
            timeout: Duration::from_millis(600),
        };
        assert!(matches!(
            Channel::handshake(
                a,
                Hello::new(Role::Decode, 0, 1),
                live,
                Duration::from_secs(1)
            ),
            Err(Error::InvalidArgument(_))
        ));
    }
}
