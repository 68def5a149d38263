//! Multi-process tests of the cross-process building blocks: shared memory, the control channel
//! and its failure detection, and (on a GPU) VMM export/import, legacy IPC and interprocess
//! events.
//!
//! The peer processes are this test binary run again with `--exact child_entry` and the role in
//! `KVSHARD_IPC_CHILD`; `child_entry` does nothing in an ordinary run.

mod common;

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::gpu::memory::{DeviceAllocation, PinnedAllocation};
use kvshard::gpu::vmm::{
    ExportableMemory, ImportedMemory, IpcEvent, IpcMapping, IpcMemHandle, HANDLE_BYTES,
};
use kvshard::gpu::Gpu;
use kvshard::ipc::wire::{
    self, Handle64, Hello, LayerAt, Message, PoolSharing, ProtocolError, PublishPool,
    PublishedComponent, Region, Register, Role,
};
use kvshard::ipc::{recv_any, Channel, Listener, Liveness, SharedMemory};
use kvshard::transfer::{ChunkResult, ChunkStatus, ComponentBytes};
use kvshard::Error;
use rand::{Rng, RngCore, SeedableRng};

const CHILD: &str = "KVSHARD_IPC_CHILD";
const SOCKET: &str = "KVSHARD_IPC_SOCKET";
const CHILD_SEED: &str = "KVSHARD_IPC_SEED";
const CHILD_RANK: &str = "KVSHARD_IPC_RANK";
/// A `Register` for this request makes a "serve" child abort on the spot.
const DIE: u64 = u64::MAX;
/// Generous: a child has to start, and a GPU child to create its context.
const STARTUP: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Parent-side helpers

/// A child process, killed and reaped if the test ends before it does.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    fn spawn(role: &str, socket: &Path, seed: u64, rank: u32) -> Peer {
        let child = Command::new(std::env::current_exe().expect("test binary path"))
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .env(SOCKET, socket)
            .env(CHILD_SEED, seed.to_string())
            .env(CHILD_RANK, rank.to_string())
            // The harness's own chatter; a child's panic message goes to stderr.
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child test process");
        Peer(child)
    }

    fn pid(&self) -> rustix::process::Pid {
        rustix::process::Pid::from_child(&self.0)
    }

    /// Waits (bounded) for the child to exit and asserts it succeeded.
    fn finish(mut self, what: &str) {
        let deadline = Instant::now() + STARTUP;
        loop {
            match self.0.try_wait().expect("wait for child") {
                Some(status) => {
                    assert!(status.success(), "{what}: child exited with {status}");
                    return;
                }
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                None => panic!("{what}: child still running after {STARTUP:?}"),
            }
        }
    }
}

fn socket_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvshard-{}-{test}.sock", std::process::id()))
}

fn decode_hello() -> Hello {
    Hello::new(Role::Decode, 0, 1)
}

fn listen(test: &str) -> Listener {
    Listener::bind(socket_path(test), decode_hello(), Liveness::default()).expect("bind")
}

/// The next message from `ch`, which must come within `STARTUP`.
fn next(ch: &mut Channel, what: &str) -> kvshard::ipc::Received {
    match ch.recv_timeout(STARTUP) {
        Ok(Some(r)) => r,
        Ok(None) => panic!("{what}: no message within {STARTUP:?}"),
        Err(e) => panic!("{what}: {e}"),
    }
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

fn seed(test: &str) -> u64 {
    common::rng(test).random()
}

fn one_region_pool(
    pool: u64,
    memory: PoolSharing,
    bytes: u64,
    handle: Option<Handle64>,
) -> Message {
    Message::PublishPool(PublishPool {
        pool,
        memory,
        regions: vec![Region { bytes, handle }],
        components: vec![PublishedComponent {
            name: "target_latent".into(),
            layers: vec![
                LayerAt {
                    region: 0,
                    offset: 0,
                },
                LayerAt {
                    region: 0,
                    offset: bytes / 2,
                },
            ],
            page_stride: 576 * 64,
            pages: bytes / 2 / (576 * 64),
        }],
        geometry: b"latent=trtllm page=64 layers=2".to_vec(),
    })
}

/// The report a child of rank `rank` sends for a chunk (every chunk here is a request's last):
/// `bytes` of the target latent, or the failure.
fn chunk_from(rank: u32, request: u64, chunk: u32, bytes: u64, failed: Option<String>) -> Message {
    let result = match failed {
        Some(reason) => ChunkResult::Failed { reason },
        None => {
            let mut counted = ComponentBytes::default();
            counted.add(kvshard::geometry::Component::TargetLatent, bytes);
            ChunkResult::Sent {
                bytes: counted,
                last: true,
            }
        }
    };
    Message::Chunk(ChunkStatus {
        request,
        rank,
        chunk,
        result,
    })
}

/// The report this (child) process sends, with the rank it was given.
fn chunk_report(request: u64, chunk: u32, bytes: u64, failed: Option<String>) -> Message {
    chunk_from(env_u64(CHILD_RANK) as u32, request, chunk, bytes, failed)
}

// ---------------------------------------------------------------------------------------------
// Child side

fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn child_connect() -> Channel {
    let socket = std::env::var(SOCKET).expect("socket path");
    let rank = env_u64(CHILD_RANK) as u32;
    Channel::connect(
        socket,
        Hello::new(Role::Prefill, rank, 4),
        Liveness::default(),
        STARTUP,
    )
    .expect("child connects")
}

/// Entry point of every child process; a no-op in an ordinary run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    match role.as_str() {
        "shm" => child_shm(),
        "echo" => child_echo(),
        "serve" => child_serve(),
        "gpu_vmm" => child_gpu_vmm(),
        "gpu_ipc" => child_gpu_ipc(),
        "gpu_event" => child_gpu_event(),
        other => panic!("unknown child role {other}"),
    }
}

fn child_shm() {
    let mut ch = child_connect();
    let seed = env_u64(CHILD_SEED);
    let mut r = next(&mut ch, "child: pool");
    let Message::PublishPool(pool) = &r.message else {
        panic!("child: expected PublishPool, got {:?}", r.message);
    };
    assert_eq!(pool.memory, PoolSharing::CpuMemfd);
    let len = pool.regions[0].bytes as usize;
    let shm = SharedMemory::from_fd(r.fds.remove(0), len).expect("child maps the memfd");
    let mut seen = vec![0u8; len];
    shm.read_at(0, &mut seen).expect("read");
    let failed = (seen != random_bytes(seed, len)).then(|| "child saw other bytes".to_string());
    // Writes a pattern of its own over the second layer.
    let half = len / 2;
    shm.write_at(half, &random_bytes(seed + 1, len - half))
        .expect("write");
    ch.send(&chunk_report(1, 0, (len - half) as u64, failed))
        .expect("child reports");
    ch.bye().expect("bye");
}

fn child_echo() {
    let mut ch = child_connect();
    loop {
        let r = next(&mut ch, "child: echo");
        if r.message == Message::Bye {
            ch.bye().expect("bye");
            return;
        }
        let fds: Vec<_> = r.fds.iter().map(|fd| fd.as_fd()).collect();
        ch.send_with_fds(&r.message, &fds).expect("echo");
    }
}

fn child_serve() {
    let mut ch = child_connect();
    loop {
        let r = next(&mut ch, "child: serve");
        match r.message {
            Message::Register(reg) if reg.request == DIE => {
                // No core dump: writing one would delay the exit the parent is timing.
                let none = rustix::process::Rlimit {
                    current: Some(0),
                    maximum: Some(0),
                };
                let _ = rustix::process::setrlimit(rustix::process::Resource::Core, none);
                std::process::abort()
            }
            Message::Register(reg) => {
                let bytes = reg.pages.len() as u64 * 36_864;
                ch.send(&chunk_report(reg.request, 0, bytes, None))
                    .expect("report");
            }
            Message::Bye => return,
            other => panic!("child: unexpected {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (a) shared memory across processes

#[test]
fn shm_memfd_is_shared_with_a_child_process() {
    let test = "shm_memfd_is_shared_with_a_child_process";
    let seed = seed(test);
    let path = socket_path(test);
    // The child starts first: it retries until the listener's socket appears.
    let child = Peer::spawn("shm", &path, seed, 2);
    std::thread::sleep(Duration::from_millis(150));
    let listener = Listener::bind(&path, decode_hello(), Liveness::default()).expect("bind");
    let mut ch = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("child connected");
    assert_eq!(ch.peer(), &Hello::new(Role::Prefill, 2, 4));

    let len = (1 << 20) + 4096 * 3;
    let shm = SharedMemory::create("kvshard-test-pool", len).expect("memfd");
    let data = random_bytes(seed, len);
    shm.write_at(0, &data).expect("fill");
    let fd = shm.export_fd().expect("export");
    let msg = one_region_pool(1, PoolSharing::CpuMemfd, len as u64, None);
    ch.send_with_fds(&msg, &[fd.as_fd()]).expect("publish");

    let r = next(&mut ch, "parent: chunk");
    let half = len / 2;
    assert_eq!(
        r.message,
        chunk_from(2, 1, 0, (len - half) as u64, None),
        "the child's report"
    );
    let mut now = vec![0u8; len];
    shm.read_at(0, &mut now).expect("read back");
    assert_eq!(now[..half], data[..half], "first layer untouched");
    assert!(
        now[half..] == random_bytes(seed + 1, len - half)[..],
        "second layer holds the child's pattern"
    );
    assert_eq!(next(&mut ch, "parent: bye").message, Message::Bye);
    child.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (b) handshake and every message, through a child that echoes them

/// Device and inode of the file behind a descriptor.
fn file_id(fd: &OwnedFd) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::from(fd.try_clone().expect("dup"));
    let meta = file.metadata().expect("fstat");
    (meta.dev(), meta.ino())
}

#[test]
fn every_message_round_trips_through_a_child_process() {
    let test = "every_message_round_trips_through_a_child_process";
    let listener = listen(test);
    let child = Peer::spawn("echo", listener.path(), 0, 3);
    let mut ch = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("child connected");
    assert_eq!(ch.peer(), &Hello::new(Role::Prefill, 3, 4));
    assert_eq!(ch.local(), &decode_hello());

    let mut rng = common::rng(test);
    let mut handle = || {
        let mut h = [0u8; HANDLE_BYTES];
        rng.fill_bytes(&mut h);
        Some(Handle64(h))
    };
    let shm: Vec<SharedMemory> = (0..3)
        .map(|i| SharedMemory::create("kvshard-echo", 4096 * (i + 1)).expect("memfd"))
        .collect();
    let two_fd_pool = Message::PublishPool(PublishPool {
        pool: 9,
        memory: PoolSharing::CudaVmmFd,
        regions: vec![
            Region {
                bytes: 4096,
                handle: None,
            },
            Region {
                bytes: 8192,
                handle: None,
            },
        ],
        components: vec![
            PublishedComponent {
                name: "indexer".into(),
                layers: vec![LayerAt {
                    region: 1,
                    offset: 0,
                }],
                page_stride: 8448,
                pages: 0,
            },
            PublishedComponent {
                name: "shared_indexer".into(),
                layers: vec![],
                page_stride: 0,
                pages: 7,
            },
        ],
        geometry: vec![],
    });
    let messages = [
        (Message::Hello(Hello::new(Role::Decode, 7, 8)), vec![]),
        (
            one_region_pool(1, PoolSharing::CpuMemfd, 4096, None),
            vec![0],
        ),
        (two_fd_pool, vec![1, 2]),
        (
            one_region_pool(2, PoolSharing::CudaFabric, 1 << 21, handle()),
            vec![],
        ),
        (
            one_region_pool(3, PoolSharing::CudaIpc, 1 << 20, handle()),
            vec![],
        ),
        (
            Message::Register(Register {
                request: 11,
                pool: 1,
                prefix_pages: 2,
                pages: vec![5, 9, 1 << 40, 3],
                state_pages: vec![17],
            }),
            vec![],
        ),
        (chunk_from(3, 11, 4, 1 << 33, None), vec![]),
        (
            chunk_from(3, 12, 0, 0, Some("kernel rejected slot 9".into())),
            vec![],
        ),
        (
            Message::EventHandle {
                handle: handle().expect("handle"),
            },
            vec![],
        ),
        (
            Message::Abort {
                request: 12,
                reason: "decode ran out of pages".into(),
            },
            vec![],
        ),
    ];
    for (msg, fds) in &messages {
        let fds: Vec<_> = fds.iter().map(|&i| shm[i].as_fd()).collect();
        ch.send_with_fds(msg, &fds).expect("send");
        let back = next(&mut ch, msg.name());
        assert_eq!(&back.message, msg);
        assert_eq!(back.fds.len(), fds.len(), "{}: descriptors", msg.name());
        for (got, sent) in back.fds.iter().zip(&fds) {
            let sent = sent.try_clone_to_owned().expect("dup");
            assert_eq!(
                file_id(got),
                file_id(&sent),
                "{}: the same memfd came back",
                msg.name()
            );
        }
    }
    // A heartbeat is part of the protocol but never surfaces.
    ch.send(&Message::Heartbeat).expect("heartbeat");
    ch.send(&Message::Bye).expect("bye");
    assert_eq!(next(&mut ch, "bye").message, Message::Bye);
    assert!(matches!(
        ch.recv_timeout(STARTUP),
        Err(Error::PeerGone { rank: Some(3), .. })
    ));
    child.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (c) a peer that dies or hangs is detected within a second; the others are still served

/// Waits for `ch` to report its peer gone and returns how long that took from `since`.
fn gone_after(ch: &mut Channel, since: Instant, what: &str) -> Duration {
    match ch.recv_timeout(Duration::from_secs(5)) {
        Err(Error::PeerGone { .. }) => since.elapsed(),
        other => panic!("{what}: expected PeerGone, got {other:?}"),
    }
}

fn register(request: u64, pages: usize) -> Message {
    Message::Register(Register {
        request,
        pool: 1,
        prefix_pages: 0,
        pages: (0..pages as u64).map(|p| p * 3 + 1).collect(),
        state_pages: vec![],
    })
}

fn serve_one(ch: &mut Channel, request: u64) {
    ch.send(&register(request, 4)).expect("register");
    let rank = ch.peer().rank;
    assert_eq!(
        next(ch, "served").message,
        chunk_from(rank, request, 0, 4 * 36_864, None)
    );
}

#[test]
fn dead_peers_are_detected_within_a_second_and_the_rest_are_served() {
    let test = "dead_peers_are_detected_within_a_second_and_the_rest_are_served";
    let listener = listen(test);
    let a = Peer::spawn("serve", listener.path(), 0, 0);
    let b = Peer::spawn("serve", listener.path(), 0, 1);
    let mut chans = listener.accept_n(2, STARTUP).expect("both connect");
    chans.sort_by_key(|ch| ch.peer().rank);
    for (i, ch) in chans.iter_mut().enumerate() {
        ch.send(&register(100 + i as u64, 4)).expect("register");
    }
    // Both answers through the poll API, each from the right channel.
    for _ in 0..2 {
        let (i, r) = recv_any(&mut chans, STARTUP)
            .expect("poll")
            .expect("an answer");
        let r = r.expect("alive");
        assert_eq!(
            r.message,
            chunk_from(i as u32, 100 + i as u64, 0, 4 * 36_864, None)
        );
    }

    // A aborts itself mid-conversation.
    chans[0].send(&register(DIE, 1)).expect("register");
    let since = Instant::now();
    let took = gone_after(&mut chans[0], since, "aborted child");
    assert!(took < Duration::from_secs(1), "abort seen after {took:?}");
    drop(a);

    // B is still served; through recv_any, the dead channel reports first and is removed.
    let (i, r) = recv_any(&mut chans, Duration::ZERO)
        .expect("poll")
        .expect("A's error");
    assert_eq!(i, 0);
    assert!(matches!(r, Err(Error::PeerGone { rank: Some(0), .. })));
    chans.remove(0);
    serve_one(&mut chans[0], 200);

    // A new connection is accepted and served, then killed from outside.
    let mut c = Peer::spawn("serve", listener.path(), 0, 5);
    let mut ch_c = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("C connected");
    serve_one(&mut ch_c, 300);
    c.0.kill().expect("kill C");
    let since = Instant::now();
    let took = gone_after(&mut ch_c, since, "killed child");
    assert!(took < Duration::from_secs(1), "kill seen after {took:?}");

    // A stopped process keeps its socket open: only the heartbeats' absence shows it.
    let d = Peer::spawn("serve", listener.path(), 0, 6);
    let mut ch_d = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("D connected");
    serve_one(&mut ch_d, 400);
    rustix::process::kill_process(d.pid(), rustix::process::Signal::STOP).expect("SIGSTOP");
    let since = Instant::now();
    let took = gone_after(&mut ch_d, since, "stopped child");
    assert!(took < Duration::from_secs(1), "hang seen after {took:?}");
    drop(d);

    serve_one(&mut chans[0], 500);
    chans.remove(0).bye().expect("bye");
    b.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (d) garbage and oversized frames are refused with typed errors

fn raw_pair() -> (
    std::os::unix::net::UnixStream,
    std::os::unix::net::UnixStream,
) {
    std::os::unix::net::UnixStream::pair().expect("socketpair")
}

fn hello_frame() -> Vec<u8> {
    wire::encode(&Message::Hello(Hello::new(Role::Prefill, 9, 2)), 0).expect("encode")
}

fn frame(payload: &[u8], fds: u16) -> Vec<u8> {
    let mut f = wire::Header {
        fds,
        payload: payload.len() as u32,
    }
    .encode()
    .to_vec();
    f.extend_from_slice(payload);
    f
}

fn handshake(stream: std::os::unix::net::UnixStream) -> kvshard::Result<Channel> {
    Channel::handshake(
        stream,
        decode_hello(),
        Liveness::default(),
        Duration::from_secs(2),
    )
}

/// A channel past the handshake whose peer is the raw socket returned with it.
fn raw_peer() -> (Channel, std::os::unix::net::UnixStream) {
    let (a, mut raw) = raw_pair();
    raw.write_all(&hello_frame()).expect("hello");
    (handshake(a).expect("handshake"), raw)
}

fn violation(result: kvshard::Result<impl std::fmt::Debug>) -> ProtocolError {
    match result {
        Err(Error::Protocol { violation, .. }) => violation,
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

#[test]
fn garbage_and_oversized_frames_are_refused() {
    // Not a kvshard peer at all.
    let (a, mut raw) = raw_pair();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("write");
    assert!(matches!(
        violation(handshake(a)),
        ProtocolError::BadMagic { .. }
    ));

    // A 4 GiB frame is refused from its header alone, before any payload is read.
    let (a, mut raw) = raw_pair();
    let mut huge = wire::Header {
        fds: 0,
        payload: u32::MAX,
    }
    .encode()
    .to_vec();
    huge.extend_from_slice(&[0xAB; 100]);
    raw.write_all(&huge).expect("write");
    assert!(matches!(
        violation(handshake(a)),
        ProtocolError::FrameTooLarge { .. }
    ));

    // Another protocol version.
    let (a, mut raw) = raw_pair();
    let mut other = hello_frame();
    other[4..6].copy_from_slice(&(wire::VERSION + 1).to_le_bytes());
    raw.write_all(&other).expect("write");
    assert!(matches!(
        violation(handshake(a)),
        ProtocolError::Version { theirs, .. } if theirs == wire::VERSION + 1
    ));

    // A first message that is not Hello.
    let (a, mut raw) = raw_pair();
    raw.write_all(&wire::encode(&Message::Bye, 0).expect("encode"))
        .expect("write");
    assert!(matches!(
        violation(handshake(a)),
        ProtocolError::Unexpected {
            expected: "Hello",
            got: "Bye"
        }
    ));

    // Past the handshake: an unknown message variant, then the connection is finished.
    let (mut ch, mut raw) = raw_peer();
    raw.write_all(&frame(&[200, 1, 2, 3], 0)).expect("write");
    assert!(matches!(
        violation(ch.recv_timeout(Duration::from_secs(2))),
        ProtocolError::Decode(_)
    ));
    assert!(matches!(
        ch.recv_timeout(Duration::from_secs(2)),
        Err(Error::PeerGone { rank: Some(9), .. })
    ));

    // Trailing bytes after a valid message.
    let (mut ch, mut raw) = raw_peer();
    let mut payload =
        wire::encode(&Message::Bye, 0).expect("encode")[wire::HEADER_BYTES..].to_vec();
    payload.push(0);
    raw.write_all(&frame(&payload, 0)).expect("write");
    assert!(matches!(
        violation(ch.recv_timeout(Duration::from_secs(2))),
        ProtocolError::Decode(_)
    ));

    // A header that promises descriptors that never came.
    let (mut ch, mut raw) = raw_peer();
    raw.write_all(&frame(&[7], 2)).expect("write");
    assert!(matches!(
        violation(ch.recv_timeout(Duration::from_secs(2))),
        ProtocolError::FdCount {
            expected: 2,
            got: 0,
            ..
        }
    ));

    // A pool whose layers lie outside its memory.
    let (mut ch, mut raw) = raw_peer();
    let Message::PublishPool(mut pool) =
        one_region_pool(1, PoolSharing::CudaIpc, 1 << 20, Some(Handle64([1; 64])))
    else {
        unreachable!()
    };
    pool.components[0].layers[1].offset = 1 << 20;
    let payload = unchecked_payload(&Message::PublishPool(pool));
    raw.write_all(&frame(&payload, 0)).expect("write");
    assert!(matches!(
        violation(ch.recv_timeout(Duration::from_secs(2))),
        ProtocolError::Invalid { .. }
    ));

    // Descriptors past the per-frame limit are refused (and closed), not leaked.
    let (mut ch, raw) = raw_peer();
    let memfds: Vec<SharedMemory> = (0..wire::MAX_FDS + 4)
        .map(|_| SharedMemory::create("extra", 64).expect("memfd"))
        .collect();
    let fds: Vec<_> = memfds.iter().map(|m| m.as_fd()).collect();
    send_raw(&raw, &frame(&[7], 0), &fds);
    assert!(matches!(
        violation(ch.recv_timeout(Duration::from_secs(2))),
        ProtocolError::TooManyFds { .. }
    ));

    // Oversized on the sending side: refused before anything is written.
    let (mut ch, _raw) = raw_peer();
    let Message::PublishPool(mut pool) =
        one_region_pool(1, PoolSharing::CudaIpc, 1 << 20, Some(Handle64([1; 64])))
    else {
        unreachable!()
    };
    pool.geometry = vec![1; wire::MAX_PAYLOAD_BYTES];
    assert!(matches!(
        ch.send(&Message::PublishPool(pool)),
        Err(Error::InvalidArgument(_))
    ));
    ch.send(&Message::Bye).expect("the channel is still usable");
}

/// The payload `wire::encode` would frame, without its consistency check (which would refuse
/// to send what this test needs the receiver to refuse).
fn unchecked_payload(msg: &Message) -> Vec<u8> {
    postcard::to_allocvec(msg).expect("serialize")
}

fn send_raw(
    stream: &std::os::unix::net::UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space =
        vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let sent = rustix::net::sendmsg(
        stream,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .expect("sendmsg");
    assert_eq!(sent, bytes.len());
}

#[test]
fn random_bytes_never_panic_the_receiver() {
    let mut rng = common::rng("random_bytes_never_panic_the_receiver");
    for round in 0..300 {
        let (mut ch, mut raw) = raw_peer();
        let len = rng.random_range(1..200);
        let mut junk = vec![0u8; len];
        rng.fill_bytes(&mut junk);
        // Half the rounds keep a valid header so the payload decoder sees the junk.
        if round % 2 == 0 {
            junk = frame(&junk, 0);
        }
        raw.write_all(&junk).expect("write");
        drop(raw);
        loop {
            match ch.recv_timeout(Duration::from_secs(2)) {
                // Junk can spell a valid message (a lone `Bye` is one byte).
                Ok(Some(_)) => continue,
                Ok(None) => panic!("round {round}: neither a message nor an error"),
                Err(Error::Protocol { .. } | Error::PeerGone { .. }) => break,
                Err(e) => panic!("round {round}: untyped failure {e}"),
            }
        }
    }
}

#[test]
fn a_listener_replaces_only_a_stale_socket() {
    let path = socket_path("stale");
    let bind = || Listener::bind(&path, decode_hello(), Liveness::default());
    let first = bind().expect("bind");
    assert!(
        matches!(bind(), Err(Error::Os { call: "bind", .. })),
        "a live listener is kept"
    );
    drop(first);
    assert!(!path.exists(), "the socket file is removed on drop");

    // A listener whose process died: its file stays, nobody accepts. Bound and never
    // listening: a listener bound and dropped here could still accept while a process another
    // test spawns holds a copy of its descriptor (from the fork until the exec).
    {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socket");
        rustix::net::bind(&fd, &SocketAddrUnix::new(&path).expect("a path")).expect("bind");
    }
    assert!(path.exists());
    drop(bind().expect("a stale socket is replaced"));

    std::fs::write(&path, b"not a socket").expect("write");
    assert!(
        matches!(bind(), Err(Error::Os { call: "bind", .. })),
        "a file is kept"
    );
    std::fs::remove_file(&path).expect("clean up");

    // Nobody listening: connect gives up after its bound, with a typed error.
    let start = Instant::now();
    let err = Channel::connect(
        &path,
        Hello::new(Role::Prefill, 0, 1),
        Liveness::default(),
        Duration::from_millis(200),
    )
    .expect_err("no listener");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

// ---------------------------------------------------------------------------------------------
// (e) GPU: VMM export/import, legacy IPC and interprocess events across two processes

fn gpu(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(why) => {
            assert!(
                std::env::var_os("KVSHARD_REQUIRE_GPU").is_none(),
                "{test}: KVSHARD_REQUIRE_GPU is set but no GPU is usable: {why}"
            );
            // Straight to stderr: the harness hides what passing tests print.
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
            None
        }
    }
}

fn child_gpu() -> Arc<Gpu> {
    Gpu::open(0).expect("the child opens GPU 0")
}

fn htod(gpu: &Gpu, dst: u64, data: &[u8]) {
    gpu.bind().expect("bind");
    // SAFETY: `dst` is a live device allocation of at least `data.len()` bytes (callers).
    unsafe { cudarc::driver::result::memcpy_htod_sync(dst, data) }.expect("cuMemcpyHtoD");
}

fn dtoh(gpu: &Gpu, src: u64, len: usize) -> Vec<u8> {
    gpu.bind().expect("bind");
    let mut out = vec![0u8; len];
    // SAFETY: `src` is a live device allocation of at least `len` bytes (callers).
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, src) }.expect("cuMemcpyDtoH");
    out
}

#[test]
fn gpu_vmm_memory_is_exported_to_a_child_process() {
    let test = "gpu_vmm_memory_is_exported_to_a_child_process";
    let Some(gpu) = gpu(test) else { return };
    let seed = seed(test);
    let mem = ExportableMemory::new(gpu.context(), (3 << 20) + 12_345).expect("cuMemCreate");
    assert!(mem.len() >= mem.requested_len() && mem.len() % (2 << 20) == 0);
    let types = mem.handle_types();
    eprintln!(
        "{test}: {} bytes, handle types {types:?}, fabric absent because: {:?}",
        mem.len(),
        mem.fabric_absent()
    );
    assert_eq!(types.fabric, mem.fabric_handle().is_some());
    let data = random_bytes(seed, mem.len());
    htod(&gpu, mem.ptr(), &data);

    let listener = listen(test);
    let child = Peer::spawn("gpu_vmm", listener.path(), seed, 1);
    let mut ch = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("child connected");
    let fd = mem.export_fd().expect("export fd");
    let len = mem.len() as u64;
    ch.send_with_fds(
        &one_region_pool(1, PoolSharing::CudaVmmFd, len, None),
        &[fd.as_fd()],
    )
    .expect("publish fd");
    drop(fd);
    if let Some(fabric) = mem.fabric_handle() {
        ch.send(&one_region_pool(
            2,
            PoolSharing::CudaFabric,
            len,
            Some(Handle64(fabric)),
        ))
        .expect("publish fabric");
    }
    ch.send(&Message::Bye).expect("done publishing");
    let r = next(&mut ch, "child's report");
    assert_eq!(r.message, chunk_from(1, 1, 0, len, None));
    assert!(
        dtoh(&gpu, mem.ptr(), mem.len()) == random_bytes(seed + 1, mem.len()),
        "the child's pattern is in this process's mapping"
    );
    assert_eq!(next(&mut ch, "bye").message, Message::Bye);
    child.finish(test);
}

fn child_gpu_vmm() {
    let gpu = child_gpu();
    let seed = env_u64(CHILD_SEED);
    let mut ch = child_connect();
    let mut mappings = Vec::new();
    loop {
        let r = next(&mut ch, "child: pools");
        match &r.message {
            Message::PublishPool(p) if p.memory == PoolSharing::CudaVmmFd => {
                let len = p.regions[0].bytes as usize;
                let m = ImportedMemory::from_fd(gpu.context(), r.fds[0].as_fd(), len)
                    .expect("import fd");
                assert!(ImportedMemory::from_fd(gpu.context(), r.fds[0].as_fd(), len + 1).is_err());
                mappings.push(m);
            }
            Message::PublishPool(p) if p.memory == PoolSharing::CudaFabric => {
                let Some(Handle64(h)) = p.regions[0].handle else {
                    panic!("fabric pool without a handle")
                };
                let len = p.regions[0].bytes as usize;
                mappings.push(
                    ImportedMemory::from_fabric(gpu.context(), &h, len).expect("import fabric"),
                );
            }
            Message::Bye => break,
            other => panic!("child: unexpected {other:?}"),
        }
    }
    let len = mappings[0].len();
    let mut failed = None;
    for (i, m) in mappings.iter().enumerate() {
        if dtoh(&gpu, m.ptr(), len) != random_bytes(seed, len) {
            failed = Some(format!("mapping {i} holds other bytes"));
        }
    }
    htod(&gpu, mappings[0].ptr(), &random_bytes(seed + 1, len));
    // Every mapping of the allocation sees the write.
    for (i, m) in mappings.iter().enumerate() {
        if dtoh(&gpu, m.ptr(), len) != random_bytes(seed + 1, len) {
            failed = Some(format!("mapping {i} missed the write"));
        }
    }
    ch.send(&chunk_report(1, 0, len as u64, failed))
        .expect("report");
    drop(mappings);
    ch.bye().expect("bye");
}

#[test]
fn gpu_legacy_ipc_shares_a_cumemalloc_buffer_with_a_child_process() {
    let test = "gpu_legacy_ipc_shares_a_cumemalloc_buffer_with_a_child_process";
    let Some(gpu) = gpu(test) else { return };
    let seed = seed(test);
    let len = (1 << 20) + 3 * 4096;
    let buf = DeviceAllocation::new(gpu.context(), len).expect("cuMemAlloc");
    htod(&gpu, buf.ptr(), &random_bytes(seed, len));
    let (handle, size) = IpcMemHandle::of(gpu.context(), buf.ptr()).expect("cuIpcGetMemHandle");
    assert!(size >= len);
    assert!(matches!(
        IpcMemHandle::of(gpu.context(), buf.ptr() + 256),
        Err(Error::InvalidArgument(_))
    ));

    let listener = listen(test);
    let child = Peer::spawn("gpu_ipc", listener.path(), seed, 1);
    let mut ch = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("child connected");
    ch.send(&one_region_pool(
        1,
        PoolSharing::CudaIpc,
        len as u64,
        Some(Handle64(handle.to_bytes())),
    ))
    .expect("publish");
    let r = next(&mut ch, "child's report");
    assert_eq!(r.message, chunk_from(1, 1, 0, len as u64, None));
    assert!(
        dtoh(&gpu, buf.ptr(), len) == random_bytes(seed + 1, len),
        "the child's pattern is in the buffer"
    );
    assert_eq!(next(&mut ch, "bye").message, Message::Bye);
    child.finish(test);
}

fn child_gpu_ipc() {
    let gpu = child_gpu();
    let seed = env_u64(CHILD_SEED);
    let mut ch = child_connect();
    let r = next(&mut ch, "child: pool");
    let Message::PublishPool(p) = &r.message else {
        panic!("child: expected PublishPool, got {:?}", r.message);
    };
    let Some(Handle64(h)) = p.regions[0].handle else {
        panic!("IPC pool without a handle")
    };
    let len = p.regions[0].bytes as usize;
    let handle = IpcMemHandle::from_bytes(h);
    assert!(
        matches!(
            IpcMapping::open(gpu.context(), &handle, 1 << 30),
            Err(Error::InvalidArgument(_))
        ),
        "a size past the allocation is refused"
    );
    let m = IpcMapping::open(gpu.context(), &handle, len).expect("cuIpcOpenMemHandle");
    let failed =
        (dtoh(&gpu, m.ptr(), len) != random_bytes(seed, len)).then(|| "other bytes".to_string());
    htod(&gpu, m.ptr(), &random_bytes(seed + 1, len));
    ch.send(&chunk_report(1, 0, len as u64, failed))
        .expect("report");
    drop(m);
    ch.bye().expect("bye");
}

/// Opens a host-side gate on drop, so a test that fails halfway never leaves a stream waiting.
struct Gate<'a>(&'a PinnedAllocation);

impl Gate<'_> {
    fn open(&self) {
        // SAFETY: the pinned allocation is live, 4-byte aligned and at least 4 bytes; the GPU
        // only reads it.
        unsafe { std::ptr::write_volatile(self.0.host_ptr().cast::<u32>(), 1) };
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        self.open();
    }
}

#[test]
fn gpu_interprocess_event_orders_a_child_process_after_this_one() {
    let test = "gpu_interprocess_event_orders_a_child_process_after_this_one";
    let Some(gpu) = gpu(test) else { return };
    let seed = seed(test);
    let len = 1 << 20;
    let staged = DeviceAllocation::new(gpu.context(), len).expect("cuMemAlloc");
    let shared = DeviceAllocation::new(gpu.context(), len).expect("cuMemAlloc");
    htod(&gpu, staged.ptr(), &random_bytes(seed, len));
    htod(&gpu, shared.ptr(), &random_bytes(seed + 7, len));
    let flag = PinnedAllocation::new(gpu.context(), 64).expect("pinned flag");
    // SAFETY: the pinned allocation is live and at least 4 bytes; nothing reads it yet.
    unsafe { std::ptr::write_volatile(flag.host_ptr().cast::<u32>(), 0) };
    let gate = Gate(&flag);

    // The stream copies `staged` into `shared` only once the host opens the gate; the event
    // marks the copy's end.
    let stream = gpu.new_stream().expect("stream");
    let event = IpcEvent::new(gpu.context()).expect("interprocess event");
    // SAFETY: the flag's device alias stays valid until the wait is over (the gate opens it
    // before `flag` is dropped).
    unsafe { stream.wait_value_geq(flag.device_ptr(), 1) }.expect("wait on the gate");
    // SAFETY: both allocations are live device buffers of `len` bytes, kept until the stream
    // has been synchronized below.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(shared.ptr(), staged.ptr(), len, stream.raw())
    }
    .expect("cuMemcpyDtoDAsync");
    event.record(&stream).expect("record");
    assert!(!event.query().expect("query"), "the gate is still closed");

    let listener = listen(test);
    let child = Peer::spawn("gpu_event", listener.path(), seed, 1);
    let mut ch = listener
        .accept_timeout(STARTUP)
        .expect("handshake")
        .expect("child connected");
    let (handle, _) = IpcMemHandle::of(gpu.context(), shared.ptr()).expect("IPC handle");
    ch.send(&Message::EventHandle {
        handle: Handle64(event.handle().expect("event handle")),
    })
    .expect("send event");
    ch.send(&one_region_pool(
        1,
        PoolSharing::CudaIpc,
        len as u64,
        Some(Handle64(handle.to_bytes())),
    ))
    .expect("publish");

    // The child has queued its read behind the event: give a broken wait time to read early.
    let armed = next(&mut ch, "child armed");
    assert_eq!(armed.message, chunk_from(1, 1, 0, 0, None));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!event.query().expect("query"), "the gate is still closed");
    gate.open();
    stream.synchronize().expect("the copy ran");
    assert!(event.query().expect("query"));
    let r = next(&mut ch, "child's report");
    assert_eq!(r.message, chunk_from(1, 1, 1, len as u64, None));
    assert_eq!(next(&mut ch, "bye").message, Message::Bye);
    child.finish(test);
}

fn child_gpu_event() {
    let gpu = child_gpu();
    let seed = env_u64(CHILD_SEED);
    let mut ch = child_connect();
    let r = next(&mut ch, "child: event");
    let Message::EventHandle {
        handle: Handle64(event),
    } = r.message
    else {
        panic!("child: expected EventHandle, got {:?}", r.message);
    };
    let event = IpcEvent::open(gpu.context(), &event).expect("cuIpcOpenEventHandle");
    let r = next(&mut ch, "child: pool");
    let Message::PublishPool(p) = &r.message else {
        panic!("child: expected PublishPool, got {:?}", r.message);
    };
    let Some(Handle64(h)) = p.regions[0].handle else {
        panic!("IPC pool without a handle")
    };
    let len = p.regions[0].bytes as usize;
    let shared = IpcMapping::open(gpu.context(), &IpcMemHandle::from_bytes(h), len)
        .expect("cuIpcOpenMemHandle");
    let local = DeviceAllocation::new(gpu.context(), len).expect("cuMemAlloc");
    assert!(
        !event.query().expect("query"),
        "the parent's gate is closed"
    );

    let stream = gpu.new_stream().expect("stream");
    event.wait(&stream).expect("wait on the parent's event");
    // SAFETY: both buffers are live and `len` bytes; the stream is synchronized before either
    // is dropped.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(local.ptr(), shared.ptr(), len, stream.raw())
    }
    .expect("cuMemcpyDtoDAsync");
    ch.send(&chunk_report(1, 0, 0, None)).expect("armed");
    stream
        .synchronize()
        .expect("the parent's copy and then ours ran");
    assert!(event.query().expect("query"));
    let failed = (dtoh(&gpu, local.ptr(), len) != random_bytes(seed, len))
        .then(|| "read before the parent's copy".to_string());
    ch.send(&chunk_report(1, 1, len as u64, failed))
        .expect("report");
    ch.bye().expect("bye");
}
