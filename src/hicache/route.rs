//! How a HiCache transfer moves its bytes: a [`Route`] (straight between the pools with a
//! [`Method`], through the controller's device staging, or picked per call), the rule
//! [`Route::auto`] applies, and the check that refuses a route that cannot run before anything
//! changes.

use super::direct::check_direct;
use super::staged::check_relayout;
use crate::backend::{Backend, Launch};
use crate::copy::{Direction, Method};
use crate::error::{Error, Result};
use crate::pool::host::HostLayout;

/// How the controller moves a transfer's bytes. A [`Method`] converts into [`Route::Direct`],
/// so every operation also takes one directly; the default is [`Route::Auto`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Route {
    /// Straight between the device pool and the host pool on the direction's stream
    /// ([`HostTransfer::run`](super::HostTransfer::run): [`Method::Kernel`], [`Method::CopyEngine`],
    /// [`Method::BatchedCopyEngine`] or [`Method::PerBlock`]; loads on the kernel through
    /// [`HostTransfer::run_signalled`](super::HostTransfer::run_signalled)).
    Direct(Method),
    /// Through the controller's device staging ([`HostTransfer::run_staged`](super::HostTransfer::run_staged)): the copy engine
    /// moves host runs of up to [`HiCacheController::staging_pages`](super::HiCacheController::staging_pages) pages on the direction's
    /// stream and the relayout method ([`Method::Kernel`] or [`Method::CopyEngine`]) places
    /// them on the direction's relayout stream. Loads land every layer at once: each layer's
    /// [`LayerReady`](super::LayerReady) is the event after the whole load, so a consumer of layers as they land
    /// wants `Direct(Method::Kernel(..))` instead. Serves every host layout and every device
    /// pool.
    Staged(Method),
    /// kvshard picks per call from the transfer's direction and pages ([`Route::auto`]).
    #[default]
    Auto,
}

/// Pages from which [`Route::auto`] moves a transfer through the staging (a load always, a
/// backup from a page-first host pool): below them the direct kernel is as fast and a load
/// keeps its per-layer readiness.
pub const AUTO_STAGED_PAGES: usize = 64;

/// CTAs of [`Route::auto`]'s staged relayout kernel. Every relayout but the last overlaps a
/// copy, and 8 CTAs outpace PCIe there; the last one (a whole staging chunk after the last
/// copy) is the load's tail, and at 64 pages 32 CTAs shorten it enough to lift every layout
/// from 94-96% to 97.9-98.1% of pinned H2D (H200, 2026-12-02, a8be63e).
pub const AUTO_RELAYOUT_CTAS: u32 = 32;

impl Route {
    /// The route [`Route::Auto`] takes for a transfer of `pages` pages in `direction` with a
    /// host pool in `layout`, on `backend` (the direction's stream): the rule the H200 measured
    /// (2026-12-02 at 464d428, every layout at 64 and 512 pages), within 3% of the fastest route
    /// of every case:
    /// - a load of at least [`AUTO_STAGED_PAGES`] pages: the copy engine through device staging
    ///   with an [`AUTO_RELAYOUT_CTAS`]-CTA kernel relayout (97.9-98.1% of pinned H2D at 64
    ///   pages, where 8 CTAs gave 94-96%), every layer ready at the end; a smaller load: the
    ///   block kernel with a ready counter per layer, 2 CTAs;
    /// - a backup into a `layer_first` host pool: the block kernel, 2 CTAs (94.8-95.0% of D2H;
    ///   the staging gains nothing there);
    /// - a backup into a page-first host pool of at least [`AUTO_STAGED_PAGES`] pages: staged
    ///   like a load (94.7-98.1%, where the direct kernel gives 76.2-95.0%); a smaller one: the
    ///   block kernel, 4 CTAs.
    ///
    /// A consumer that overlaps a large load layer by layer with its forward pass wants
    /// `Direct(Method::Kernel(..))` instead: the staged route readies every layer at once.
    pub fn auto(
        direction: Direction,
        pages: usize,
        layout: HostLayout,
        backend: &dyn Backend,
    ) -> Route {
        let staged = Route::Staged(Method::Kernel(Launch::host_io(backend, AUTO_RELAYOUT_CTAS)));
        match direction {
            Direction::Load if pages >= AUTO_STAGED_PAGES => staged,
            Direction::Load => Route::Direct(Method::Kernel(Launch::host_io(backend, 2))),
            Direction::Backup if layout == HostLayout::LayerFirst => {
                Route::Direct(Method::Kernel(Launch::host_io(backend, 2)))
            }
            Direction::Backup if pages >= AUTO_STAGED_PAGES => staged,
            Direction::Backup => Route::Direct(Method::Kernel(Launch::host_io(backend, 4))),
        }
    }

    /// This route, with [`Route::Auto`] resolved for `pages` pages in `direction` with a host
    /// pool in `layout`.
    pub(super) fn resolve(
        self,
        direction: Direction,
        pages: usize,
        layout: HostLayout,
        backend: &dyn Backend,
    ) -> Route {
        match self {
            Route::Auto => Route::auto(direction, pages, layout, backend),
            route => route,
        }
    }
}

impl From<Method> for Route {
    fn from(method: Method) -> Self {
        Self::Direct(method)
    }
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Direct(method) => write!(f, "direct, {method}"),
            Self::Staged(method) => write!(f, "staged, {method} relayout"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

/// Refuses, before anything changes, a route that cannot run: a method the route does not
/// take ([`Error::UnsupportedMethod`]), or a kernel launch shape no copy kernel takes.
pub(super) fn check_route(route: Route) -> Result<()> {
    match route {
        Route::Direct(method) => check_direct(method),
        Route::Staged(how) => check_relayout(how),
        // Resolved per call (`Route::resolve`) before anything is planned.
        Route::Auto => Ok(()),
    }
}

/// [`Route::Auto`] reaching a step that runs a route: every public call resolves it first, so
/// this reports a bug rather than a caller's mistake, before anything is enqueued (`transfer`
/// runs first).
pub(super) fn unresolved() -> Error {
    Error::HiCache("an auto route reached a transfer unresolved".into())
}
