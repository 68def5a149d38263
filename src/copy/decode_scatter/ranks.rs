//! The tables' ranks of each kind of plan: every rank with its pages (a scatter), every rank
//! into its dense region (a packing), one rank with its pages (a scatter of one rank's rows, an
//! unpacking), and the shifts a packing or an unpacking reads.

use super::super::space::BlockSpace;
use super::checks::check_rank_pages;
use super::{DecodeScatterPlan, Mode, Targets, PAGE};
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::shard::DecodeLayout;

impl DecodeScatterPlan {
    /// The tables' ranks (their page lists, checked against their spaces and covering every row
    /// that can land on them), the shifts a packing or unpacking reads, the rows moved per
    /// section, and a packing's rows per rank and section.
    #[allow(clippy::type_complexity)]
    pub(super) fn ranks(
        src_limit: u64,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        positions: &[Vec<u64>; 2],
        mode: Mode,
        targets: &Targets,
    ) -> Result<(
        Vec<(Vec<LocalPage>, Vec<LocalPage>, u64)>,
        Vec<u64>,
        [u64; 2],
        Vec<[u64; 2]>,
    )> {
        let reach_of = |positions: &Vec<u64>| {
            let entries: Vec<(LocalPage, u64)> =
                positions.iter().map(|&p| (LocalPage(0), p)).collect();
            reach(&entries, end_token)
        };
        let (kv_rows, kv_reach) = reach_of(&positions[0]);
        let (state_rows, state_reach) = reach_of(&positions[1]);
        let dense = |rank: u32| {
            positions
                .each_ref()
                .map(|p| layout.dense_rows(rank, end_token, p))
        };
        let mut out = Vec::with_capacity(dsts.len());
        let mut shifts = Vec::new();
        let mut dense_rows = Vec::new();
        let rows = match *targets {
            Targets::Every(ranks) => {
                for (d, (rank, dst)) in (0u32..).zip(ranks.iter().zip(dsts)) {
                    let needed = [
                        layout.pages_on(d, kv_reach) * u64::from(!positions[0].is_empty()),
                        layout.pages_on(d, state_reach) * u64::from(!positions[1].is_empty()),
                    ];
                    check_rank_pages(d, rank, dst.pages(), needed)?;
                    out.push((rank.pages.clone(), rank.state_pages.clone(), dst.pages()));
                }
                [kv_rows, state_rows]
            }
            Targets::Dense => {
                let m = layout.ranks() as usize;
                let entries = positions[0].len() + positions[1].len();
                shifts = vec![0u64; entries * m];
                for (d, dst) in (0u32..).zip(dsts) {
                    let [kv, state] = dense(d);
                    for (j, &shift) in kv.shifts.iter().chain(&state.shifts).enumerate() {
                        shifts[j * m + d as usize] = shift;
                    }
                    dense_rows.push([kv.rows, state.rows]);
                    let pages = kv.pages().max(state.pages());
                    if pages > dst.pages() {
                        return Err(Error::InvalidArgument(format!(
                            "decode rank {d}'s rows take {pages} pages of its region, which holds {}",
                            dst.pages()
                        )));
                    }
                    // Both lists as long as the longer (one bound serves both), each section's
                    // own pages first and padding after: no row lands past its section's pages.
                    let list = |used: bool, own: u64| {
                        if used {
                            dense_pages(own, pages)
                        } else {
                            Vec::new()
                        }
                    };
                    out.push((
                        list(!positions[0].is_empty(), kv.pages()),
                        list(!positions[1].is_empty(), state.pages()),
                        dst.pages(),
                    ));
                }
                [kv_rows, state_rows]
            }
            Targets::One(rank, pages) => {
                let [kv, state] = dense(rank);
                if mode == Mode::Unpack {
                    let most = kv.pages().max(state.pages());
                    if most > src_limit {
                        return Err(Error::InvalidArgument(format!(
                            "decode rank {rank}'s rows take {most} pages of the packed source, which holds {src_limit}"
                        )));
                    }
                    shifts = kv.shifts.iter().chain(&state.shifts).copied().collect();
                }
                let needed = [
                    layout.pages_on(rank, kv_reach) * u64::from(!positions[0].is_empty()),
                    layout.pages_on(rank, state_reach) * u64::from(!positions[1].is_empty()),
                ];
                check_rank_pages(rank, pages, dsts[0].pages(), needed)?;
                out.push((
                    pages.pages.clone(),
                    pages.state_pages.clone(),
                    dsts[0].pages(),
                ));
                [kv.rows, state.rows]
            }
        };
        Ok((out, shifts, rows, dense_rows))
    }
}

/// Tokens of `entries` below `end_token`, and the tokens up to which their rows reach (the end,
/// or the end of the last entry's page).
fn reach(entries: &[(LocalPage, u64)], end_token: u64) -> (u64, u64) {
    let rows: u64 = entries
        .iter()
        .map(|&(_, p)| end_token.saturating_sub(p * PAGE).min(PAGE))
        .sum();
    let last = entries.iter().map(|&(_, p)| p).max();
    let reach = last.map_or(0, |p| (p * PAGE).saturating_add(PAGE).min(end_token));
    (rows, reach)
}

/// The page list of a dense region's section of `own` pages: pages `0..own`, then padding ids
/// (`u64::MAX`, which the kernel reads as a negative id: skipped) up to `len`.
fn dense_pages(own: u64, len: u64) -> Vec<LocalPage> {
    (0..len)
        .map(|p| LocalPage(if p < own { p } else { u64::MAX }))
        .collect()
}
