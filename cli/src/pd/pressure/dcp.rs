//! The decodes as decode context-parallel (DCP) groups (docs/pd.md, "Into DCP decode groups"):
//! what a group's ranks and the prefill ranks share, and the decode rank's side.
//!
//! Every process derives any decode rank's pages of both prompts the same way
//! ([`group_registrations`]); what travels is still the protocol's: each decode rank publishes
//! its pool and registers its share (`DecodeRegistration::rank`) on its control channel, and
//! rank 0 of a group hands the group's `DecodeRegistration` of each prompt to every prefill
//! rank as a [`Message::DecodeRegistration`] line on the group's registration socket. A decode
//! rank checks its rows against the unsharded reference re-laid out by the layout's formula.

use std::fmt;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::copy::BlockSpace;
use kvshard::geometry::{ComponentLayout, INDEXER_HEAD_DIM, INDEXER_SCALES_OFFSET, PAGE_SIZE};
use kvshard::index::LocalPage;
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement, ShardAllocator};
use kvshard::transfer::{DecodeEndpoint, DecodeRank, DecodeRegistration, PoolLayout, Registration};
use kvshard::{Error, Result};

use super::super::message::Message;
use super::super::{layer_range, Role, STARTUP};
use super::PressurePdConfig;
use crate::demo::pressure::{PROMPT_1, PROMPT_2};
use crate::synth::POISON;

const PAGE: u64 = PAGE_SIZE as u64;

/// The registration socket of decode group `group`: the run's socket path and `.g{group}.reg`.
pub(super) fn registration_socket(base: &Path, group: u32) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(format!(".g{group}.reg"));
    path.into()
}

/// Decode rank `rank`'s share of each prompt, in prompt order, in a pool of `layout`: its pages
/// as the rank allocates them, a poisoned guard page before each prompt's `pages_on` pages.
fn rank_shares(
    cfg: &PressurePdConfig,
    layout: &PoolLayout,
    rank: u32,
) -> Result<Vec<Registration>> {
    let unsharded = Placement::unsharded();
    let mut alloc = ShardAllocator::new(unsharded, layout.pages)?;
    let tokens = cfg
        .decode_layout
        .tokens_on(rank, cfg.scenario.prompt_tokens as u64);
    let tokens = usize::try_from(tokens).map_err(|_| crate::overflow("a rank's tokens"))?;
    [PROMPT_1, PROMPT_2]
        .into_iter()
        .map(|request| {
            RequestChain::new(unsharded).grow_to(&mut alloc, 1)?;
            let mut chain = RequestChain::new(unsharded);
            chain.grow_to(&mut alloc, tokens)?;
            Registration::of_chain(&chain, request, layout.clone(), 0)
        })
        .collect()
}

/// The group's registration of each prompt, every rank's pool of `layout` (the ranks' pools
/// are alike), checked.
pub(super) fn group_registrations(
    cfg: &PressurePdConfig,
    layout: &PoolLayout,
) -> Result<Vec<DecodeRegistration>> {
    let shares = (0..cfg.decode_layout.ranks())
        .map(|d| rank_shares(cfg, layout, d))
        .collect::<Result<Vec<_>>>()?;
    (0..2)
        .map(|prompt| {
            let registration = DecodeRegistration {
                request: shares[0][prompt].request,
                layout: cfg.decode_layout,
                tokens: cfg.scenario.prompt_tokens,
                prefix_pages: 0,
                ranks: shares
                    .iter()
                    .map(|s| DecodeRank {
                        layout: layout.clone(),
                        pages: s[prompt].pages.clone(),
                        state_pages: s[prompt].state_pages.clone(),
                    })
                    .collect(),
            };
            registration.validate()?;
            Ok(registration)
        })
        .collect()
}

/// The message carrying `registration` (the pools stay the ones each rank published).
pub(super) fn to_message(registration: &DecodeRegistration) -> Message {
    let pages = |of: fn(&DecodeRank) -> &Vec<LocalPage>| {
        registration
            .ranks
            .iter()
            .map(|r| of(r).iter().map(|p| p.0).collect())
            .collect()
    };
    Message::DecodeRegistration {
        request: registration.request,
        ranks: registration.layout.ranks(),
        interleave: registration.layout.interleave(),
        tokens: registration.tokens as u64,
        prefix_pages: registration.prefix_pages as u64,
        pages: pages(|r| &r.pages),
        state_pages: pages(|r| &r.state_pages),
    }
}

/// The registration `message` carries, decode rank `d`'s pool of `layouts[d]` (what it
/// published); checked.
pub(super) fn from_message(
    message: &Message,
    layouts: &[PoolLayout],
) -> Result<DecodeRegistration> {
    let Message::DecodeRegistration {
        request,
        ranks,
        interleave,
        tokens,
        prefix_pages,
        pages,
        state_pages,
    } = message
    else {
        return Err(Error::InvalidArgument(format!(
            "a {} where a DecodeRegistration belongs",
            message.kind()
        )));
    };
    if pages.len() != layouts.len() || state_pages.len() != layouts.len() {
        return Err(Error::InvalidArgument(format!(
            "a registration of {} ranks for a group of {}",
            pages.len(),
            layouts.len()
        )));
    }
    let local = |p: &Vec<u64>| p.iter().map(|&p| LocalPage(p)).collect();
    let registration = DecodeRegistration {
        request: *request,
        layout: DecodeLayout::new(*ranks, *interleave)?,
        tokens: usize::try_from(*tokens).map_err(|_| crate::overflow("a request's tokens"))?,
        prefix_pages: usize::try_from(*prefix_pages)
            .map_err(|_| crate::overflow("a request's prefix"))?,
        ranks: layouts
            .iter()
            .zip(pages.iter().zip(state_pages))
            .map(|(layout, (pages, state))| DecodeRank {
                layout: layout.clone(),
                pages: local(pages),
                state_pages: local(state),
            })
            .collect(),
    };
    registration.validate()?;
    Ok(registration)
}

/// Decode rank 0 of a group: hands `registrations` to each of `ranks` prefill ranks as they
/// connect to `listener`, within `timeout`.
fn serve_registrations(
    listener: &UnixListener,
    registrations: &[DecodeRegistration],
    ranks: u32,
    timeout: Duration,
) -> Result<()> {
    let os = |call| move |source| Error::Os { call, source };
    let lines: String = registrations
        .iter()
        .map(|r| to_message(r).to_line() + "\n")
        .collect();
    listener
        .set_nonblocking(true)
        .map_err(os("make the registration socket non-blocking"))?;
    let start = Instant::now();
    let mut served = 0;
    while served < ranks {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_write_timeout(Some(timeout)))
                    .and_then(|()| stream.write_all(lines.as_bytes()))
                    .map_err(os("hand a prefill rank the group's registrations"))?;
                served += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && start.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return Err(Error::Timeout {
                    what: format!("the prefill ranks' registrations ({served} of {ranks} came)"),
                    waited: start.elapsed(),
                })
            }
            Err(e) => return Err(os("accept a prefill rank's registration connection")(e)),
        }
    }
    Ok(())
}

/// A prefill rank: the `count` registration messages decode process `from` (rank 0 of a group)
/// hands out on `path`, within `timeout` (the socket may not be bound yet).
pub(super) fn fetch_registrations(
    path: &Path,
    from: Role,
    count: usize,
    timeout: Duration,
) -> Result<Vec<Message>> {
    let os = |call| move |source| Error::Os { call, source };
    let start = Instant::now();
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(stream) => break stream,
            Err(_) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(os("connect to a decode group's registration socket")(e)),
        }
    };
    let left = timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .map_err(os("bound the registration socket's reads"))?;
    let mut out = Vec::with_capacity(count);
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(os("read a decode group's registrations"))?;
        match Message::from_line(&line, from) {
            Ok(Some(m @ Message::DecodeRegistration { .. })) => out.push(m),
            Ok(_) => {
                return Err(Error::InvalidArgument(format!(
                    "{from} sent a line that is no registration: {line}"
                )))
            }
            Err(e) => return Err(Error::InvalidArgument(format!("{from}: {e}"))),
        }
        if out.len() == count {
            return Ok(out);
        }
    }
    Err(Error::PeerGone {
        rank: None,
        why: format!(
            "{from} closed its registration socket after {} of {count}",
            out.len()
        ),
    })
}

/// A decode process as rank `rank` of DCP group `group`, with the group's registrations.
pub(super) struct GroupRank {
    group: u32,
    rank: u32,
    registrations: Vec<DecodeRegistration>,
}

impl fmt::Display for GroupRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "decode group {} rank {}", self.group, self.rank)
    }
}

impl GroupRank {
    /// Decode process `index` (rank `index % M` of group `index / M`) registers its share of
    /// each prompt with its endpoint (published pool `pool_id`, `pool`); rank 0 then hands the
    /// group's registrations to every prefill rank on the group's registration socket (by the
    /// run's `socket`).
    pub(super) fn register(
        cfg: &PressurePdConfig,
        socket: &Path,
        index: u32,
        endpoint: &mut DecodeEndpoint,
        pool_id: u64,
        pool: &DevicePool,
    ) -> Result<GroupRank> {
        let m = cfg.decode_layout.ranks();
        let (group, rank) = (index / m, index % m);
        let registrations = group_registrations(cfg, &PoolLayout::of(pool))?;
        for registration in &registrations {
            endpoint.register(pool_id, registration.rank(rank)?)?;
        }
        if rank == 0 {
            let path = registration_socket(socket, group);
            let listener = UnixListener::bind(&path).map_err(|source| Error::Os {
                call: "bind a decode group's registration socket",
                source,
            })?;
            let served =
                serve_registrations(&listener, &registrations, cfg.scenario.shape.ranks, STARTUP);
            let _ = std::fs::remove_file(&path);
            served?;
        }
        Ok(GroupRank {
            group,
            rank,
            registrations,
        })
    }

    /// Checks this rank's rows of prompt `prompt` in `pool` against the unsharded `reference`
    /// (the prompt's pages in it: `ref_chain`) re-laid out: token `t`'s rows on rank
    /// `(t / I) % M` as local token `k = (t / (I M)) I + t % I`, row `k % 64` of the rank's
    /// `(k / 64)`-th page; the rows of no token on its last page still the poison. Returns the
    /// rows checked. Blocks the host (reads).
    pub(super) fn verify_sync(
        &self,
        b: &dyn Backend,
        pool: &DevicePool,
        reference: &DevicePool,
        ref_chain: &RequestChain,
        prompt: usize,
    ) -> Result<u64> {
        let registration = &self.registrations[prompt];
        let share = &registration.ranks[self.rank as usize];
        let layout = registration.layout;
        let rows = layout.tokens_on(self.rank, registration.tokens as u64);
        let src = ref_chain.pages()?;
        let read = |p: &DevicePool, c, l| -> Result<Vec<u8>> {
            let storage = p.storage().ok_or_else(|| {
                Error::InvalidArgument("pd pools are allocated by kvshard".into())
            })?;
            let (offset, len) = layer_range(p, c, l)?;
            b.read_sync(storage, offset, len)
        };
        for (c, comp) in pool.components().iter().enumerate() {
            let pages = if comp.component.is_indexer() {
                &share.state_pages
            } else {
                &share.pages
            };
            for l in 0..comp.layers() {
                let (got, want) = (read(pool, c, l)?, read(reference, c, l)?);
                for k in 0..pages.len() as u64 * PAGE {
                    let at = |page: u64, row: u64| (page as usize, row as usize);
                    let dst = at(pages[(k / PAGE) as usize].0, k % PAGE);
                    let token = layout.token(self.rank, k).filter(|_| k < rows);
                    let differs = match token {
                        Some(t) => {
                            let from = at(src[(t / PAGE) as usize].0, t % PAGE);
                            row_pieces(comp, from, dst)
                                .any(|(s, d, n)| got[d..d + n] != want[s..s + n])
                        }
                        None => row_pieces(comp, dst, dst)
                            .any(|(_, d, n)| got[d..d + n].iter().any(|&x| x != POISON)),
                    };
                    if differs {
                        return Err(Error::Verification(format!(
                            "{self}: request {}: {} stored layer {l} local token {k} ({}) \
                             differs from the reference re-laid out",
                            registration.request,
                            comp.component,
                            token.map_or("no token: the poison".into(), |t| format!("token {t}"))
                        )));
                    }
                }
            }
        }
        Ok(rows)
    }
}

/// The byte ranges of one token's row in a layer of `comp`: (source offset, destination offset,
/// length) from row `from.1` of page `from.0` to row `to.1` of page `to.0` (pages of a packed
/// layer). A latent row is one range; an indexer row is its key and its scale, apart in the
/// page-major block (64 keys of 128 bytes, then 64 f32 scales).
fn row_pieces(
    comp: &ComponentLayout,
    from: (usize, usize),
    to: (usize, usize),
) -> impl Iterator<Item = (usize, usize, usize)> {
    let block = comp.block_bytes;
    let (s, d) = (from.0 * block, to.0 * block);
    let pieces = if comp.component.is_indexer() {
        let key = INDEXER_HEAD_DIM;
        let scale = INDEXER_SCALES_OFFSET;
        vec![
            (s + from.1 * key, d + to.1 * key, key),
            (s + scale + 4 * from.1, d + scale + 4 * to.1, 4),
        ]
    } else {
        let r = comp.row_bytes;
        vec![(s + from.1 * r, d + to.1 * r, r)]
    };
    pieces.into_iter()
}

/// Rows a decode rank of `cfg` holds of a prompt: its local tokens.
pub(super) fn rows_of(cfg: &PressurePdConfig, rank: u32) -> u64 {
    cfg.decode_layout
        .tokens_on(rank, cfg.scenario.prompt_tokens as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Platform;

    fn dcp(m: u32, i: u32) -> PressurePdConfig {
        let mut cfg = PressurePdConfig::default_for(Platform::Cpu);
        cfg.decode_layout = DecodeLayout::new(m, i).unwrap();
        cfg.processes.decodes = m;
        cfg
    }

    #[test]
    fn a_group_registration_crosses_as_its_message_and_back() {
        for (m, i) in [(2, 1), (4, 64), (3, 16)] {
            let cfg = dcp(m, i);
            let layout = PoolLayout::packed(cfg.scenario.shape.geometry(), cfg.decode_pages());
            let registrations = group_registrations(&cfg, &layout).unwrap();
            assert_eq!(registrations.len(), 2);
            let layouts = vec![layout.clone(); m as usize];
            for r in &registrations {
                assert_eq!(from_message(&to_message(r), &layouts).unwrap(), *r);
                // Each rank holds its share: pages_on of its rows, after the guard page.
                for (d, rank) in r.ranks.iter().enumerate() {
                    let tokens = cfg.scenario.prompt_tokens as u64;
                    assert_eq!(rank.pages.len() as u64, r.layout.pages_on(d as u32, tokens));
                }
            }
            // A message for another group size, or of another kind, is refused.
            assert!(from_message(&to_message(&registrations[0]), &layouts[1..]).is_err());
            assert!(from_message(&Message::Storage { lines: Vec::new() }, &layouts).is_err());
        }
    }

    #[test]
    fn a_registration_that_does_not_fit_its_pools_is_refused() {
        let cfg = dcp(2, 1);
        let layout = PoolLayout::packed(cfg.scenario.shape.geometry(), cfg.decode_pages());
        let registration = group_registrations(&cfg, &layout).unwrap().remove(0);
        // The pools a prefill rank mapped are smaller than the pages the message names.
        let small = PoolLayout::packed(cfg.scenario.shape.geometry(), 8);
        let message = to_message(&registration);
        assert!(from_message(&message, &[small.clone(), small]).is_err());
    }
}
