//! The control channel: framed [`Message`]s with attached file descriptors over a Unix-domain
//! stream socket, a handshake, heartbeats and bounded-time detection of a gone peer.
//!
//! The decode process binds a [`Listener`] and accepts one [`Channel`] per prefill process
//! ([`Listener::accept_n`]); each prefill process calls [`Channel::connect`], which retries until
//! the socket appears. [`Channel::recv_timeout`] serves one peer, [`recv_any`] several. The wire
//! format is in [`super::wire`] and the module docs of [`super`].
//!
//! The socket underneath (frames, descriptors, the receive buffers, telling a gone peer) is
//! `link` (private); this file makes connections of it: connect and accept, the handshake, the
//! heartbeat thread, waiting on several channels.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

pub use super::link::Received;
use super::link::{deadline_after, poll, send_failure, write_frame, Link, Shared};
use super::wire::{self, Hello, Message, ProtocolError};
use crate::error::{Error, Result};
use crate::lock::lock;

/// Pause between connection attempts while the listener's socket does not exist yet.
const CONNECT_RETRY: Duration = Duration::from_millis(20);

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

    // Old behaviour: once the heartbeat thread's write had failed (the peer closed after its
    // Bye), the next receive reported the peer gone without reading the socket: the peer's
    // last messages and its Bye were lost (seen as a flaky failure of the test above).
    #[test]
    fn what_the_peer_sent_before_closing_outlives_a_failed_heartbeat() {
        let (mut a, mut b) = pair_with(Liveness {
            heartbeat: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
        });
        b.send(&Message::Abort {
            request: 7,
            reason: "last".into(),
        })
        .unwrap();
        b.bye().unwrap();
        // As the heartbeat thread records a write that met the closed socket.
        *lock(&a.link.shared.send_failed) = Some("connection closed while sending".into());
        let first = a.recv_timeout(Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(first.message.name(), "Abort");
        let second = a.recv_timeout(Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(second.message, Message::Bye);
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
