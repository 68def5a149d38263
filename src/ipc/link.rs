//! One control connection's socket: whole frames written with their descriptors attached
//! (from the caller's thread or the heartbeat thread, never interleaved), bytes and descriptors
//! read without blocking and taken apart into [`Received`] messages, and the bookkeeping that
//! tells a gone peer (end of stream, a violation, a failed send, silence). [`super::channel`]
//! builds connections, handshakes and heartbeats on it; the wire format is [`super::wire`].

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::wire::{self, Header, Message, ProtocolError, HEADER_BYTES, MAX_FDS};
use crate::error::{Error, Result};
use crate::lock::lock;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 64 * 1024;
/// Why a peer that said `Bye` is gone.
const SAID_BYE: &str = "said Bye";
/// Control-message space for the most descriptors one frame may carry.
const CMSG_SPACE: usize = rustix::cmsg_space!(ScmRights(MAX_FDS));

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
pub(super) struct Shared {
    pub(super) stream: UnixStream,
    /// Held for a whole frame, so frames from the two threads never interleave.
    write: Mutex<()>,
    pub(super) stop: Mutex<bool>,
    pub(super) wake: Condvar,
    /// Why a send failed (either thread); the connection is unusable from then on.
    pub(super) send_failed: Mutex<Option<String>>,
}

/// Writes one whole frame, descriptors attached to its first bytes.
pub(super) fn write_frame(
    shared: &Shared,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
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

pub(super) fn send_failure(e: &std::io::Error, timeout: Duration) -> String {
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

/// The receive side of a connection: buffered bytes and descriptors, and how it ended.
#[derive(Debug)]
pub(super) struct Link {
    pub(super) shared: Arc<Shared>,
    /// The peer's rank once its Hello has arrived.
    pub(super) rank: Option<u32>,
    rx: Vec<u8>,
    rx_fds: VecDeque<OwnedFd>,
    pub(super) last_heard: Instant,
    /// An error to report once (a protocol violation found while reading), then `broken`.
    pending: Option<Error>,
    /// Why the connection is unusable both ways (violation, silence, failed send, reset).
    broken: Option<String>,
    /// Why the peer will send nothing more (its `Bye`, or the end of the stream); sending may
    /// still work (the peer may be reading until it closes).
    finished: Option<String>,
}

impl Link {
    pub(super) fn new(stream: UnixStream) -> Self {
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

    pub(super) fn send(
        &mut self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<()> {
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
    pub(super) fn fill(&mut self) {
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
    pub(super) fn ready(&mut self, silence: Option<Duration>) -> Result<Option<Received>> {
        if let Some(r) = self.next_frame()? {
            return Ok(Some(r));
        }
        if let Some(why) = self.finished.clone() {
            return Err(self.gone_error(&why));
        }
        let send_failed = lock(&self.shared.send_failed).clone();
        if let Some(why) = send_failed {
            // The heartbeat's write fails once the peer has closed, but what the peer sent
            // before closing (a final status, its Bye) still waits in the socket: it is
            // delivered, a frame a call, before the connection is reported gone.
            if let Some(r) = self.read_waiting()? {
                return Ok(Some(r));
            }
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
        if let Some(r) = self.read_waiting()? {
            return Ok(Some(r));
        }
        let silent = self.last_heard.elapsed();
        if silent < limit {
            return Ok(None);
        }
        Err(self.break_off(format!(
            "silent for {silent:.2?} (liveness timeout {limit:?})"
        )))
    }

    /// Reads what waits in the socket now: its next frame, the peer's end (an error), or
    /// nothing yet.
    fn read_waiting(&mut self) -> Result<Option<Received>> {
        self.fill();
        if let Some(r) = self.next_frame()? {
            return Ok(Some(r));
        }
        match self.finished.clone() {
            Some(why) => Err(self.gone_error(&why)),
            None => Ok(None),
        }
    }

    /// How long a wait may last before the liveness limit needs checking again.
    pub(super) fn until_silent(&self, silence: Option<Duration>) -> Option<Duration> {
        silence.map(|limit| limit.saturating_sub(self.last_heard.elapsed()))
    }

    /// Blocks until a message, the peer's end, or `deadline` (`Ok(None)`).
    pub(super) fn recv_until(
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
pub(super) fn poll(fds: &mut [PollFd<'_>], wait: Duration) -> Result<usize> {
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

pub(super) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    // A timeout too large for the clock means "no deadline" in practice: a century will do.
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}
