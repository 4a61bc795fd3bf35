//! Deterministic discrete-event simulation of one training iteration.
//!
//! Every simulated *instance* runs a [`Program`](crate::graph::Program): on each stream the next
//! op starts as soon as the stream is free and the op's cross-stream dependencies are done.
//! Kernels take their cost-model time; a collective starts when every participant has reached
//! it, and ends for all of them together; a send moves its bytes and fills the receiver's
//! mailbox. Traffic that crosses the scale-out fabric is a flow in the [`Network`], which shares
//! link bandwidth max-min fairly with everything else in flight.
//!
//! Events are ordered by `(time, sequence number)` with integer picosecond times, so a run is a
//! pure function of the job and options.
//!
//! Modes:
//! - [`Mode::Full`]: every rank is an instance.
//! - [`Mode::Reduced`]: one instance per pipeline stage (its symmetry class). Collectives start on
//!   the representative's arrival (its peers do identical work and arrive at the same time), and
//!   each flow carries the link usage of *all* its symmetric copies, so links see exactly the load
//!   they see in the full run. Gives exactly the full run's timings when the job is symmetric,
//!   which [`symmetry_check`] verifies before running.
//! - [`Mode::Slice`]: the requested ranks are the representatives of their stages (PrismLLM's
//!   real ranks) and every other rank is replayed as a virtual participant of its class.

use crate::cost::comm::{self, CommParams, CommPlan, GroupShape};
use crate::cost::compute::{ComputeModel, ComputeParams, KernelTable};
use crate::graph::{ExecutionGraph, NUM_STREAMS, OpKind, Program, Stream};
use crate::job::{Cluster, Job};
use crate::layout::{GROUP_KINDS, GroupKind, Layout};
use crate::network::{Fabric, FlowEnd, FlowId, LinkId, Network, normalize};
use crate::ops::OpClass;
use crate::report::{Breakdown, RankTiming, Summary};
use crate::units::{SimTime, ps_from_s};

/// Which ranks to simulate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Every rank.
    #[default]
    Full,
    /// One representative per symmetry class (pipeline stage).
    Reduced,
    /// These ranks, with everything else replayed from symmetry.
    Slice(Vec<u32>),
}

/// Options of one simulation.
#[derive(Clone, Debug, Default)]
pub struct SimOptions {
    /// Which ranks are simulated.
    pub mode: Mode,
    /// Compute efficiency parameters; `None` picks the GPU generation's defaults.
    pub compute: Option<ComputeParams>,
    /// Communication parameters; `None` picks the GPU generation's calibrated values.
    pub comm: Option<CommParams>,
    /// Measured kernel times that override the roofline.
    pub kernel_table: Option<KernelTable>,
    /// Ranks whose every op is recorded (for traces).
    pub record_ranks: Vec<u32>,
    /// Communication costs nothing (for checks against schedule formulas).
    pub ideal_network: bool,
    /// Random variation of this iteration (one Monte Carlo sample); an asymmetric one needs
    /// `Mode::Full`.
    pub perturbation: Option<std::sync::Arc<dyn Perturb>>,
    /// Every kernel is an event of its own (no fusion of back-to-back kernels): slower, with
    /// the same result; it exists to check the fusion.
    pub unfused: bool,
}

/// The random state of one perturbed iteration (one Monte Carlo sample), as the engine sees it:
/// a time factor for every compute kernel and one for all communication. The engine calls it and
/// never draws anything itself; `prism-predict` implements it from a job's `[variability]`.
///
/// Contract: `kernel_factor` is a pure function of its arguments (the same rank and op give the
/// same factor however often and in whatever order it is asked), so a sample does not depend on
/// event order or threads; factors are positive and finite.
pub trait Perturb: std::fmt::Debug + Send + Sync {
    /// Time factor of compute op `op` (its index in the rank's program; of `class`, named
    /// `name`) on `rank`.
    fn kernel_factor(&self, rank: u32, op: u32, class: OpClass, name: &str) -> f64;
    /// Time factor of every collective and send of this iteration (correlated congestion);
    /// each collective's duration is shared by all its participants.
    fn comm_factor(&self) -> f64;
    /// True when every rank of a stage gets the same factors, so reduced and sliced runs stay
    /// exact.
    fn is_symmetric(&self) -> bool;
}

/// One executed op of a recorded rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// Op id in the rank's program.
    pub op: u32,
    /// Start time, ps.
    pub start: SimTime,
    /// End time, ps.
    pub end: SimTime,
}

/// The recorded ops of one rank.
#[derive(Clone, Debug)]
pub struct RankTimeline {
    /// Rank.
    pub rank: u32,
    /// Ops in completion order.
    pub ops: Vec<OpRecord>,
}

/// Why a simulation could not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// A rank in a slice or record list does not exist.
    #[error("rank {rank} does not exist (the job has {ranks} ranks)")]
    NoSuchRank {
        /// Requested rank.
        rank: u32,
        /// Ranks in the job.
        ranks: u32,
    },
    /// The job's placement is not symmetric, so a reduced or sliced run would not be exact.
    #[error("reduced and sliced runs need a symmetric placement: {0}; run the full simulation")]
    Asymmetric(String),
    /// An option is out of range.
    #[error("invalid simulation option: {0}")]
    InvalidOption(String),
    /// The job's graph would exceed the size limit (`graph::MAX_OPS`).
    #[error("{0}")]
    TooLarge(String),
    /// An iteration would last longer than the engine's time range.
    #[error(
        "the iteration would last longer than {:.1} days of simulated time (the engine's limit); \
         check the cluster's bandwidths, latencies and peak FLOP/s and the model's sizes",
        crate::units::s_from_ps(crate::units::TIME_LIMIT) / 86400.0
    )]
    TooLong,
    /// An external rank's hook failed (a real rank crashed, sent the wrong call, timed out).
    #[error("{0}")]
    External(String),
    /// The simulation stopped with work left (a dependency cycle): a bug.
    #[error("simulation deadlocked at rank {rank} stream {stream}: {detail}")]
    Deadlock {
        /// Rank.
        rank: u32,
        /// Stream name.
        stream: &'static str,
        /// What it waited for.
        detail: String,
    },
}

/// One transfer over a directed WAN link (multi-datacenter jobs): a flow's time on the link
/// and the bytes all its copies moved over it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WanTransfer {
    /// Directed WAN link: `2 i` for `a -> b` of the job's link `i`, `2 i + 1` for `b -> a`.
    pub link: u32,
    /// Start, ps.
    pub start: SimTime,
    /// End, ps.
    pub end: SimTime,
    /// Bytes over the link (all copies the flow stands for).
    pub bytes: u64,
}

/// Result of a simulation.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// Headline numbers.
    pub summary: Summary,
    /// Per simulated rank timings (every rank in full mode; representatives and the requested
    /// ranks otherwise), by rank.
    pub ranks: Vec<RankTiming>,
    /// Recorded timelines.
    pub timelines: Vec<RankTimeline>,
    /// The graph that was simulated.
    pub graph: ExecutionGraph,
    /// Events processed.
    pub events: u64,
    /// Transfers over WAN links, in completion order (empty for a single-DC job).
    pub wan: Vec<WanTransfer>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    OpDone {
        inst: u32,
        stream: u8,
    },
    /// The kernel chain of generation `generation` of `inst` ended (a stale generation was
    /// re-priced and is ignored).
    ChainDone {
        inst: u32,
        generation: u32,
    },
    CollDone {
        kind: u8,
        id: u32,
    },
    SendDone {
        inst: u32,
    },
    Flow {
        flow: u32,
        generation: u32,
    },
    /// A WAN link's turn ended: waiting pipeline sends may start.
    WanFree,
}

/// The pending-event set: the events of the current instant in a FIFO; later events in one
/// FIFO bucket per distinct time, with the distinct times in a monotone radix heap (time never
/// goes backwards in the engine, which is what a radix heap needs). An instant's bucket moves to
/// the FIFO whole, so "every event of this instant is done" is exact, and pop order is a pure
/// function of the push sequence. Buckets are looked up by key only (never iterated).
struct EventQueue {
    now: SimTime,
    current: std::collections::VecDeque<Event>,
    times: radix_heap::RadixHeapMap<u64, ()>,
    buckets: rustc_hash::FxHashMap<SimTime, Vec<Event>>,
    pool: Vec<Vec<Event>>,
}

impl EventQueue {
    fn new() -> Self {
        EventQueue {
            now: 0,
            current: Default::default(),
            times: radix_heap::RadixHeapMap::new(),
            buckets: Default::default(),
            pool: Vec::new(),
        }
    }

    fn push(&mut self, time: SimTime, ev: Event) {
        debug_assert!(time >= self.now, "event scheduled in the past");
        if time == self.now {
            self.current.push_back(ev);
            return;
        }
        match self.buckets.entry(time) {
            std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().push(ev),
            std::collections::hash_map::Entry::Vacant(e) => {
                let mut v = self.pool.pop().unwrap_or_default();
                v.push(ev);
                e.insert(v);
                // Max-heap over the complement of time = min-heap over time.
                self.times.push(u64::MAX - time, ());
            }
        }
    }

    /// True when no event is left at the current instant.
    fn instant_done(&self) -> bool {
        self.current.is_empty()
    }

    fn pop(&mut self) -> Option<(SimTime, Event)> {
        if self.current.is_empty() {
            let (k, ()) = self.times.pop()?;
            self.now = u64::MAX - k;
            let mut v = self
                .buckets
                .remove(&self.now)
                .expect("bucket of a pending time");
            self.current.extend(v.drain(..));
            self.pool.push(v);
        }
        self.current.pop_front().map(|ev| (self.now, ev))
    }
}

#[derive(Clone, Copy, Debug)]
enum Owner {
    Coll {
        kind: u8,
        id: u32,
        min_end: SimTime,
        latency: SimTime,
    },
    Send {
        inst: u32,
        min_end: SimTime,
        latency: SimTime,
    },
}

const NOT_YET: SimTime = SimTime::MAX;
const WAIT_NONE: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Inst {
    rank: u32,
    prog: u32,
    pc: [u32; NUM_STREAMS],
    busy: [bool; NUM_STREAMS],
    /// SMs the NCCL kernel of each busy stream holds ([`Contention::op_sms`], set as it starts).
    sms: [u32; NUM_STREAMS],
    started: [SimTime; NUM_STREAMS],
    last_done: [SimTime; NUM_STREAMS],
    mailbox: u32,
    recv_wait: u32,
    last_compute_end: SimTime,
    timing: RankTiming,
    record: Option<usize>,
    /// The kernels of the chain in flight, (op, start, end), committed when it ends; empty
    /// when none is.
    chain: Vec<(u32, SimTime, SimTime)>,
    /// Generation of the chain in flight (bumped when it is re-priced).
    chain_gen: u32,
    /// SMs NCCL held when the chain in flight was priced.
    chain_extra: u32,
    /// Queued for re-pricing at the end of this instant.
    replan: bool,
}

impl Inst {
    /// SMs held by the NCCL kernels in flight on the busy streams (at most 255, more than any
    /// GPU has: the cost model keeps one SM for compute whatever is held). Zero without
    /// contention, where no op sets [`Inst::sms`].
    fn held_sms(&self) -> u32 {
        (0..NUM_STREAMS)
            .filter(|&s| self.busy[s])
            .map(|s| self.sms[s])
            .fold(0u32, u32::saturating_add)
            .min(255)
    }
}

struct GroupState {
    arrived: Vec<u32>,
    start: Vec<SimTime>,
    size: u32,
}

/// [`simulate`] in `opts.mode`, or with every rank (`Mode::Full`) when that mode needs a
/// symmetry the job or the perturbation does not have (an asymmetric placement, per-rank
/// draws). Reduced and slice runs are exact where allowed, so the answer is the full run's
/// either way.
pub fn simulate_or_full(job: &Job, opts: &SimOptions) -> Result<SimResult, SimError> {
    match simulate(job, opts) {
        Err(SimError::Asymmetric(_)) if opts.mode != Mode::Full => simulate(
            job,
            &SimOptions {
                mode: Mode::Full,
                ..opts.clone()
            },
        ),
        r => r,
    }
}

/// Simulates one iteration of a validated job.
pub fn simulate(job: &Job, opts: &SimOptions) -> Result<SimResult, SimError> {
    crate::graph::size_check(job).map_err(SimError::TooLarge)?;
    simulate_with_graph(job, ExecutionGraph::build(job), opts)
}

/// [`simulate`] of `job` running `graph` instead of the graph the job builds: the job's graph
/// with ops added (e.g. [`crate::insert::with_compute_inserted`]: inference prefill placed in
/// the pipeline bubbles). Compute ops with [`Work::Measured`](crate::ops::Work::Measured)
/// durations take them; the others are priced by the job's cost model.
pub fn simulate_with_graph(
    job: &Job,
    graph: ExecutionGraph,
    opts: &SimOptions,
) -> Result<SimResult, SimError> {
    if graph.programs.len() != graph.layout.pp as usize
        || graph.layout.pp != job.parallel.pp
        || graph.layout.num_ranks() as u64 != job.num_gpus()
    {
        return Err(SimError::InvalidOption(
            "the graph does not belong to the job (its layout differs)".into(),
        ));
    }
    let layout = graph.layout;
    let n = layout.num_ranks();
    for &r in opts.record_ranks.iter().chain(match &opts.mode {
        Mode::Slice(v) => v.iter(),
        _ => [].iter(),
    }) {
        if r >= n {
            return Err(SimError::NoSuchRank { rank: r, ranks: n });
        }
    }
    let compute_params = opts
        .compute
        .clone()
        .unwrap_or_else(|| ComputeParams::for_gpu(&job.cluster.gpu));
    let compute = ComputeModel::new(job, compute_params.clone(), opts.kernel_table.clone());
    let comm_params = opts
        .comm
        .clone()
        .unwrap_or_else(|| CommParams::for_gpu(&job.cluster.gpu));
    let nic_bps = comm::nic_bytes_per_s(&job.cluster, &comm_params);
    let fabric = Fabric::new(&job.cluster, nic_bps);
    // Representatives: in full mode every rank; otherwise one per stage.
    let reps: Vec<u32> = match &opts.mode {
        Mode::Full => (0..n).collect(),
        Mode::Reduced | Mode::Slice(_) => {
            symmetry_check(job, &layout, &fabric)?;
            let wanted: &[u32] = match &opts.mode {
                Mode::Slice(v) => v,
                _ => &[],
            };
            (0..layout.pp)
                .map(|s| {
                    wanted
                        .iter()
                        .copied()
                        .find(|&r| layout.coord(r).pp == s)
                        .unwrap_or(layout.first_rank_of_stage(s))
                })
                .collect()
        }
    };
    let full = opts.mode == Mode::Full;
    if !full
        && opts
            .perturbation
            .as_ref()
            .is_some_and(|p| !p.is_symmetric())
    {
        return Err(SimError::Asymmetric(
            "a perturbed (Monte Carlo) iteration breaks the symmetry between ranks".into(),
        ));
    }
    if let Some(p) = &opts.perturbation
        && !(p.comm_factor().is_finite() && p.comm_factor() > 0.0)
    {
        return Err(SimError::InvalidOption(format!(
            "perturbation.comm_factor must be a positive finite number (got {})",
            p.comm_factor()
        )));
    }
    let durations: Vec<Vec<SimTime>> = graph
        .programs
        .iter()
        .map(|p| {
            p.kind
                .iter()
                .map(|k| match k {
                    OpKind::Compute(op) => compute.time_ps(op),
                    _ => 0,
                })
                .collect()
        })
        .collect();
    let cfg = RunCfg {
        record_ranks: &opts.record_ranks,
        ideal_network: opts.ideal_network,
        perturbation: opts.perturbation.as_deref(),
        unfused: opts.unfused,
    };
    let external = vec![Vec::new(); reps.len()];
    let mut sim = Sim::new(
        &job.cluster,
        &graph,
        durations,
        cfg,
        fabric,
        reps,
        full,
        external,
        None,
    );
    sim.comm = comm_params;
    // The SM counts are NCCL's Hopper defaults; Ampere has no NVLink SHARP and its ring channel
    // count is left unmodelled (its kernels run beside communication at full speed, as before).
    let hopper_or_later = crate::cost::compute::Generation::of(&job.cluster.gpu)
        != crate::cost::compute::Generation::Ampere;
    if !opts.ideal_network && hopper_or_later {
        sim.contention = Some(Contention::new(
            job,
            compute_params,
            opts.kernel_table.clone(),
        ));
    }
    sim.run()?;
    let (iteration_ps, mut ranks) = sim.finish();
    let t = iteration_ps as f64 * 1e-12;
    // Averages weight each simulated instance by the ranks it stands for (all equal here:
    // full mode has one rank per instance, reduced mode one stage per instance).
    let mut avg = Breakdown::default();
    for r in &ranks {
        avg.add(&r.breakdown);
    }
    avg.scale(1.0 / ranks.len().max(1) as f64);
    let stage_peak = (0..layout.pp)
        .map(|s| crate::memory::stage_memory(job, s).total())
        .collect::<Vec<u64>>();
    let summary = Summary::new(job, t, avg, stage_peak, &graph);
    // Slices: report every requested rank with its representative's timing.
    if let Mode::Slice(wanted) = &opts.mode {
        let mut out = Vec::new();
        for &r in wanted {
            let stage = layout.coord(r).pp;
            let rep = ranks
                .iter()
                .find(|t| layout.coord(t.rank).pp == stage)
                .expect("stage rep");
            out.push(RankTiming {
                rank: r,
                ..rep.clone()
            });
        }
        out.sort_by_key(|t| t.rank);
        out.dedup_by_key(|t| t.rank);
        ranks = out;
    }
    let timelines = sim.timelines;
    let events = sim.events;
    let wan = sim.wan_done;
    Ok(SimResult {
        summary,
        ranks,
        timelines,
        graph,
        events,
        wan,
    })
}

/// The ranks of a graph run whose compute durations are supplied at run time (the *real*
/// ranks of hybrid emulation), and who hear when each of their communication ops completes.
///
/// The engine asks for a compute op's duration once every event of the instant at which the
/// op starts has been handled (so every completion of that instant has been reported first),
/// in the order the ops started; the call may block (a real rank is still computing). A run is
/// deterministic when the hook's answers are.
pub trait External {
    /// Duration (ps) of compute op `op` (its id in the rank's program) of external `rank`,
    /// which starts at emulated time `start`. An error ends the run with
    /// [`SimError::External`].
    fn compute_ps(&mut self, rank: u32, op: u32, start: SimTime) -> Result<SimTime, String>;
    /// Communication op `op` of external `rank` completed at emulated time `end`. An error ends
    /// the run with [`SimError::External`].
    fn comm_done(&mut self, rank: u32, op: u32, end: SimTime) -> Result<(), String>;
}

/// Options of a run of a given graph ([`simulate_graph`]).
#[derive(Clone, Debug, Default)]
pub struct GraphOptions {
    /// Which ranks are instances: every rank, or one per pipeline stage (exact when the
    /// placement is symmetric, refused with [`SimError::Asymmetric`] otherwise).
    pub mode: Mode,
    /// Communication parameters; `None` picks the cluster GPU's calibrated values.
    pub comm: Option<CommParams>,
    /// Ranks whose every op is recorded.
    pub record_ranks: Vec<u32>,
    /// Communication costs nothing.
    pub ideal_network: bool,
    /// Ranks whose compute durations come from the [`External`] hook. In a reduced or slice
    /// run, the instance of a stage stands for every external rank of that stage (it is the
    /// stage's representative) and takes the longest of their durations; every other rank of
    /// the stage replays it.
    pub external_ranks: Vec<u32>,
}

/// Result of [`simulate_graph`].
#[derive(Clone, Debug)]
pub struct GraphResult {
    /// The iteration: the last end of any rank, ps.
    pub iteration_ps: SimTime,
    /// Timings of the simulated instances, by rank (every rank in full mode; one representative
    /// per stage otherwise, external ranks preferred).
    pub ranks: Vec<RankTiming>,
    /// Recorded timelines.
    pub timelines: Vec<RankTimeline>,
    /// Events processed.
    pub events: u64,
}

/// Runs a given execution graph (for example one built from recorded traces, whose compute
/// ops are [`Work::Measured`](crate::ops::Work::Measured) segments) on `cluster`: the same
/// engine as [`simulate`], without a job. Compute ops must carry measured durations; ranks in
/// `opts.external_ranks` get theirs from `hook` instead.
pub fn simulate_graph<'a>(
    graph: &'a ExecutionGraph,
    cluster: &'a Cluster,
    opts: &'a GraphOptions,
    hook: Option<&'a mut dyn External>,
) -> Result<GraphResult, SimError> {
    let layout = graph.layout;
    let n = layout.num_ranks();
    if graph.programs.len() != layout.pp as usize {
        return Err(SimError::InvalidOption(format!(
            "the graph has {} programs for {} pipeline stages",
            graph.programs.len(),
            layout.pp
        )));
    }
    if (layout.num_ranks() as u64) > cluster.num_gpus() {
        return Err(SimError::InvalidOption(format!(
            "the graph has {} ranks, more than the {} GPUs of cluster {}",
            layout.num_ranks(),
            cluster.num_gpus(),
            cluster.name
        )));
    }
    if layout.gpus_per_node != cluster.gpus_per_node {
        return Err(SimError::InvalidOption(format!(
            "the graph's layout assumes {} GPUs per node, cluster {} has {}",
            layout.gpus_per_node, cluster.name, cluster.gpus_per_node
        )));
    }
    for &r in opts
        .record_ranks
        .iter()
        .chain(&opts.external_ranks)
        .chain(match &opts.mode {
            Mode::Slice(v) => v.iter(),
            _ => [].iter(),
        })
    {
        if r >= n {
            return Err(SimError::NoSuchRank { rank: r, ranks: n });
        }
    }
    if !opts.external_ranks.is_empty() && hook.is_none() {
        return Err(SimError::InvalidOption(
            "external ranks need a hook that supplies their compute".into(),
        ));
    }
    let mut durations = Vec::with_capacity(graph.programs.len());
    for (s, p) in graph.programs.iter().enumerate() {
        let mut d = Vec::with_capacity(p.len());
        for (op, k) in p.kind.iter().enumerate() {
            d.push(match k {
                OpKind::Compute(c) => match c.work {
                    crate::ops::Work::Measured { ps } => ps,
                    _ => {
                        return Err(SimError::InvalidOption(format!(
                            "op {op} ({}) of stage {s} has no measured duration; a graph without \
                             a job runs measured segments only",
                            c.name
                        )));
                    }
                },
                _ => 0,
            });
        }
        durations.push(d);
    }
    let comm_params = opts
        .comm
        .clone()
        .unwrap_or_else(|| CommParams::for_gpu(&cluster.gpu));
    let nic_bps = comm::nic_bytes_per_s(cluster, &comm_params);
    let fabric = Fabric::new(cluster, nic_bps);
    let mut ext: Vec<u32> = opts.external_ranks.clone();
    ext.sort_unstable();
    ext.dedup();
    let full = opts.mode == Mode::Full;
    let reps: Vec<u32> = if full {
        (0..n).collect()
    } else {
        symmetry_check_layout(&layout, &fabric)?;
        let wanted: &[u32] = match &opts.mode {
            Mode::Slice(v) => v,
            _ => &[],
        };
        (0..layout.pp)
            .map(|s| {
                (ext.iter().chain(wanted))
                    .copied()
                    .find(|&r| layout.coord(r).pp == s)
                    .unwrap_or(layout.first_rank_of_stage(s))
            })
            .collect()
    };
    let external: Vec<Vec<u32>> = reps
        .iter()
        .map(|&r| {
            if full {
                ext.iter().copied().filter(|&e| e == r).collect()
            } else {
                let s = layout.coord(r).pp;
                ext.iter()
                    .copied()
                    .filter(|&e| layout.coord(e).pp == s)
                    .collect()
            }
        })
        .collect();
    let cfg = RunCfg {
        record_ranks: &opts.record_ranks,
        ideal_network: opts.ideal_network,
        perturbation: None,
        unfused: false,
    };
    let mut sim = Sim::new(
        cluster, graph, durations, cfg, fabric, reps, full, external, hook,
    );
    sim.comm = comm_params;
    sim.run()?;
    let (iteration_ps, ranks) = sim.finish();
    Ok(GraphResult {
        iteration_ps,
        ranks,
        timelines: std::mem::take(&mut sim.timelines),
        events: sim.events,
    })
}

/// Checks that every rank of a pipeline stage sees the same network: every group of a kind has
/// the same shape, and every NIC and leaf link is crossed by the same number of copies of each
/// flow class. Reduced and sliced runs are exact only then.
pub fn symmetry_check(job: &Job, layout: &Layout, fabric: &Fabric) -> Result<(), SimError> {
    debug_assert_eq!(job.parallel.pp, layout.pp);
    symmetry_check_layout(layout, fabric)
}

/// [`symmetry_check`] for a layout alone (a graph without a job, e.g. from recorded traces).
pub fn symmetry_check_layout(layout: &Layout, fabric: &Fabric) -> Result<(), SimError> {
    for kind in GROUP_KINDS {
        let first = group_shape(layout, kind, 0);
        for g in 1..layout.group_count(kind) {
            if group_shape(layout, kind, g) != first {
                return Err(SimError::Asymmetric(format!(
                    "{kind:?} group {g} is placed differently from group 0"
                )));
            }
        }
    }
    // Per flow class, the per-link counts of its copies must be uniform over the links of each
    // type it touches (NIC tx, NIC rx, leaf up, leaf down).
    let mut links = Vec::new();
    let classes = flow_classes(layout);
    for class in &classes {
        links.clear();
        class_links(layout, fabric, class, &mut links);
        let mut per_type: [Option<u32>; 8] = [None; 8];
        for &(l, c) in &links {
            let t = fabric.link_type(l);
            match per_type[t] {
                None => per_type[t] = Some(c),
                Some(x) if x == c => {}
                Some(x) => {
                    return Err(SimError::Asymmetric(format!(
                        "{} crosses some links {x} times and others {c} times",
                        class.describe()
                    )));
                }
            }
        }
        // Each copy of the class must also touch the same number of leaf links.
        if class.copies_touching_leaves(layout, fabric) {
            return Err(SimError::Asymmetric(format!(
                "only some copies of {} cross the spine",
                class.describe()
            )));
        }
    }
    Ok(())
}

/// A class of symmetric flows: one collective kind of one stage, or the sends of one stage in
/// one direction.
#[derive(Clone, Copy, Debug)]
enum FlowClass {
    Group { kind: GroupKind, stage: u32 },
    Send { stage: u32, delta: i8 },
}

impl FlowClass {
    fn describe(&self) -> String {
        match self {
            FlowClass::Group { kind, stage } => {
                format!("the {kind:?} collectives of stage {stage}")
            }
            FlowClass::Send { stage, delta } => {
                format!("the sends of stage {stage} (direction {delta})")
            }
        }
    }

    /// True when some copies cross leaf (or pod) uplinks and others do not, or not as often.
    fn copies_touching_leaves(&self, layout: &Layout, fabric: &Fabric) -> bool {
        let mut counts: Vec<[usize; 8]> = Vec::new();
        let mut buf = Vec::new();
        for_each_copy(layout, fabric, self, &mut buf, |links| {
            let mut per_type = [0; 8];
            for &(l, c) in links {
                per_type[fabric.link_type(l)] += c as usize;
            }
            counts.push(per_type);
        });
        counts.windows(2).any(|w| w[0] != w[1])
    }
}

fn flow_classes(layout: &Layout) -> Vec<FlowClass> {
    let mut out = Vec::new();
    for stage in 0..layout.pp {
        for kind in GROUP_KINDS {
            if layout.group_size(kind) > 1 {
                out.push(FlowClass::Group { kind, stage });
            }
        }
        if layout.pp > 1 {
            out.push(FlowClass::Send { stage, delta: 1 });
            out.push(FlowClass::Send { stage, delta: -1 });
        }
    }
    out
}

fn wrap_peer(layout: &Layout, rank: u32, delta: i8) -> u32 {
    let c = layout.coord(rank);
    let pp = ((c.pp + layout.pp) as i64 + delta as i64) as u32 % layout.pp;
    layout.rank(crate::layout::Coord { pp, ..c })
}

/// Calls `f` with the links of every copy of `class` (each copy's links in `buf`).
fn for_each_copy(
    layout: &Layout,
    fabric: &Fabric,
    class: &FlowClass,
    buf: &mut Vec<(LinkId, u32)>,
    mut f: impl FnMut(&[(LinkId, u32)]),
) {
    match *class {
        FlowClass::Group { kind, stage } => {
            let per_stage = layout.group_count(kind) / layout.pp;
            let mut members = Vec::new();
            for g in stage * per_stage..(stage + 1) * per_stage {
                members.clear();
                members.extend(layout.members(kind, g));
                buf.clear();
                group_links(fabric, kind, &members, buf);
                f(buf);
            }
        }
        FlowClass::Send { stage, delta } => {
            for r in layout.stage_ranks(stage) {
                let peer = wrap_peer(layout, r, delta);
                buf.clear();
                if !fabric.same_node(r, peer) {
                    fabric.route(r, peer, buf);
                }
                f(buf);
            }
        }
    }
}

fn class_links(layout: &Layout, fabric: &Fabric, class: &FlowClass, out: &mut Vec<(LinkId, u32)>) {
    let mut buf = Vec::new();
    for_each_copy(layout, fabric, class, &mut buf, |links| {
        out.extend_from_slice(links)
    });
    normalize(out);
}

fn group_links(fabric: &Fabric, kind: GroupKind, members: &[u32], out: &mut Vec<(LinkId, u32)>) {
    if kind == GroupKind::Ep {
        fabric.all_to_all_links(members, out);
    } else {
        fabric.ring_links(members, out);
    }
}

/// How group `group` of `kind` sits on nodes: its ranks, the nodes it spans and the most
/// members on one node.
pub(crate) fn group_shape(layout: &Layout, kind: GroupKind, group: u32) -> GroupShape {
    let mut nodes: Vec<u32> = layout
        .members(kind, group)
        .map(|r| layout.node(r))
        .collect();
    let ranks = nodes.len() as u32;
    nodes.sort_unstable();
    let mut per_node = 0u32;
    let mut distinct = 0u32;
    let mut i = 0;
    while i < nodes.len() {
        let j = nodes[i..].iter().take_while(|&&x| x == nodes[i]).count();
        per_node = per_node.max(j as u32);
        distinct += 1;
        i += j;
    }
    GroupShape {
        ranks,
        nodes: distinct,
        per_node,
    }
}

/// What a run needs besides the graph: the options that reach the event loop.
#[derive(Clone, Copy)]
struct RunCfg<'a> {
    record_ranks: &'a [u32],
    ideal_network: bool,
    perturbation: Option<&'a dyn Perturb>,
    unfused: bool,
}

struct Sim<'a> {
    cluster: &'a Cluster,
    graph: &'a ExecutionGraph,
    layout: Layout,
    opts: RunCfg<'a>,
    comm: CommParams,
    /// Per instance, the external ranks it stands for (empty: a virtual instance).
    external: Vec<Vec<u32>>,
    /// Supplies the compute durations of external instances and hears of their communication.
    hook: Option<&'a mut dyn External>,
    /// Compute ops of external instances started at this instant, whose durations are asked
    /// for once every event of the instant is done: (instance, op).
    pending: Vec<(u32, u32)>,
    /// Compute ops of simulated instances started at this instant, whose kernel chains are
    /// priced once every event of the instant is done: (instance, op).
    starting: Vec<(u32, u32)>,
    /// Instances whose chain in flight saw the SMs held by NCCL change at this instant.
    replans: Vec<u32>,
    /// The first error a hook returned.
    hook_error: Option<SimError>,
    full: bool,
    /// Compute durations per program per op (0 for non-compute ops).
    durations: Vec<Vec<SimTime>>,
    /// Compute slowed by NCCL kernels in flight (jobs with a cost model and a real network).
    contention: Option<Contention<'a>>,
    insts: Vec<Inst>,
    /// rank -> instance (full mode) ; stage -> instance otherwise.
    inst_of: Vec<u32>,
    mail: Vec<(SimTime, SimTime)>,
    groups: Vec<GroupState>,
    shapes: Vec<Vec<Option<GroupShape>>>,
    links_cache: Vec<Vec<Option<Links>>>,
    send_links_cache: Vec<Option<Links>>,
    fabric: Fabric,
    net: Network,
    owners: Vec<Option<Owner>>,
    queue: EventQueue,
    now: SimTime,
    events: u64,
    scratch_links: Vec<(LinkId, u32)>,
    members_scratch: Vec<u32>,
    flow_ends: Vec<FlowEnd>,
    timelines: Vec<RankTimeline>,
    remaining_ops: u64,
    /// An event fell beyond `units::TIME_LIMIT`.
    too_long: bool,
    /// WAN latency per step of each cached collective (same shape as `links_cache`).
    wan_lat_cache: Vec<Vec<Option<SimTime>>>,
    /// Temporal sharing of WAN links ([`crate::wan::WanSharing::Temporal`]).
    turns: WanTurns,
    /// Per stage and send direction: the WAN limits those sends ([`Sim::wan_contended`]).
    contended: Vec<Option<bool>>,
    /// Per flow id: when it started and the bytes it moves over each WAN link it crosses.
    wan_flows: Vec<Option<WanFlow>>,
    /// Finished WAN transfers.
    wan_done: Vec<WanTransfer>,
}

/// A flow's start and the bytes it moves over each WAN link it crosses (directed WAN index).
type WanFlow = (SimTime, Vec<(u32, u64)>);

/// Temporal sharing of WAN links: who owns each link, and the sends waiting for their turn.
#[derive(Default)]
struct WanTurns {
    /// Per WAN link: the pipeline (tag) owning it, its flows in flight, and the time until
    /// which the other pipelines' turns (reduced runs) keep it.
    gates: std::collections::BTreeMap<LinkId, (Option<u64>, u32, SimTime)>,
    /// Sends waiting for their turn, in arrival order.
    waiting: std::collections::VecDeque<Waiting>,
    /// Per flow id: the WAN links it owns, when it started, its pipeline tag.
    owned: Vec<Option<(Vec<LinkId>, SimTime, u64)>>,
    /// Reduced runs: the largest delay of the last pipeline behind the representative.
    lag: SimTime,
}

struct Waiting {
    links: Links,
    wan: Vec<LinkId>,
    plan: CommPlan,
    owner: Owner,
    tag: u64,
}

/// Link usages of one flow.
type Links = Vec<(LinkId, u32)>;

fn kind_index(kind: GroupKind) -> usize {
    GROUP_KINDS.iter().position(|&k| k == kind).expect("kind")
}

/// SMs one NCCL collective kernel holds while it runs (or waits for its peers) beside the
/// computation: its CTAs, one per channel, each filling an SM a GEMM tile can no longer use.
/// 16 is NCCL's NVLink SHARP channel count on Hopper (`NVLS_NCHANNELS_SM90`,
/// src/transport/nvls.cc), the usual count of a large collective there.
pub const NCCL_COLLECTIVE_SMS: u32 = 16;

/// SMs one NCCL pipeline send or receive kernel holds: NCCL gives a peer across the network
/// `max(NICs per GPU, ceil(NIC GB/s / 14))` channels (`NCCL_P2P_PER_CHANNEL_NET_BW` = 14 GB/s,
/// src/graph/paths.cc), rounded up to a power of two: 4 with one 400 Gb/s NIC per GPU, as on
/// every H100 cluster of the calibration set. Prism keeps 4 whatever `cluster.nic_gbps` says
/// (NCCL gives 2 at 200 Gb/s and 8 at 800 Gb/s), so that a faster network never slows the
/// computation beside it in the model.
pub const NCCL_P2P_SMS: u32 = 4;

/// Compute kernels that start while NCCL kernels of their GPU are in flight run on the SMs
/// those leave (Hopper and later, whose NCCL defaults the counts are): each busy communication stream holds its kernel's SMs (a collective from its
/// arrival to its end, a receive from its posting to its message, a send while it moves), and
/// each kernel is priced for the SMs held as it starts, once every event of that instant is
/// done (a fused chain is re-priced from the instant they change). Communication that reserves its
/// SMs for the whole run (`parallel.comm_sms`: expert all-to-alls; Transformer Engine
/// userbuffers under `tp_comm_overlap`, priced on the GEMMs they overlap) adds none here.
struct Contention<'a> {
    job: &'a Job,
    params: ComputeParams,
    table: Option<KernelTable>,
    /// SMs held by the kernel of each stream while it is busy.
    sms: [u32; NUM_STREAMS],
    /// Compute models with `extra` more SMs held, by `extra` (a few: sums of the streams' SMs).
    models: std::collections::BTreeMap<u32, ComputeModel>,
    /// Direct-mapped memo of priced kernels: slot -> ((program, op, extra) packed, ps). The
    /// ranks of a stage run the same ops at nearly the same time, so the slot is usually warm;
    /// a collision only costs a recomputation (prices are pure).
    memo: Vec<(u64, SimTime)>,
}

/// Slots of [`Contention::memo`] (a power of two).
const MEMO_SLOTS: usize = 1 << 16;

impl<'a> Contention<'a> {
    fn new(job: &'a Job, params: ComputeParams, table: Option<KernelTable>) -> Self {
        let p = &job.parallel;
        let coll = NCCL_COLLECTIVE_SMS;
        let p2p = NCCL_P2P_SMS;
        let mut sms = [0u32; NUM_STREAMS];
        sms[Stream::Tp as usize] = if p.tp_comm_overlap { 0 } else { coll };
        // Gathered keys and values and Ulysses all-to-alls are collectives; ring attention's
        // exchanges hold a send and a receive kernel instead ([`Contention::op_sms`]).
        sms[Stream::Cp as usize] = coll;
        sms[Stream::Ep as usize] = if p.comm_sms > 0 { 0 } else { coll };
        sms[Stream::PpSend as usize] = p2p;
        sms[Stream::PpRecv as usize] = p2p;
        sms[Stream::Dp as usize] = coll;
        Contention {
            job,
            params,
            table,
            sms,
            models: std::collections::BTreeMap::new(),
            memo: vec![(u64::MAX, 0); MEMO_SLOTS],
        }
    }

    /// SMs held by op `kind` in flight on stream `s`: the stream's kernel, except that a ring
    /// exchange (ring attention's step) is a send and a receive kernel, `NCCL_P2P_SMS` each,
    /// on whichever stream runs it.
    fn op_sms(&self, s: usize, kind: &OpKind) -> u32 {
        match kind {
            OpKind::Collective {
                op: comm::Collective::RingExchange,
                ..
            } if self.sms[s] > 0 => 2 * NCCL_P2P_SMS,
            _ => self.sms[s],
        }
    }

    /// Duration of compute op `op` of program `prog` (kernel `c`) with `extra` SMs held by NCCL.
    fn duration(&mut self, prog: u32, op: u32, c: &crate::ops::ComputeOp, extra: u32) -> SimTime {
        debug_assert!(prog < 1 << 24 && extra < 1 << 8);
        let key = (prog as u64) << 40 | (op as u64) << 8 | extra as u64;
        let slot = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 48) as usize & (MEMO_SLOTS - 1);
        if self.memo[slot].0 == key {
            return self.memo[slot].1;
        }
        let (job, params, table) = (self.job, &self.params, &self.table);
        let model = self.models.entry(extra).or_insert_with(|| {
            ComputeModel::with_extra_sms(job, params.clone(), table.clone(), extra)
        });
        let d = model.time_ps(c);
        self.memo[slot] = (key, d);
        d
    }
}

impl<'a> Sim<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cluster: &'a Cluster,
        graph: &'a ExecutionGraph,
        durations: Vec<Vec<SimTime>>,
        opts: RunCfg<'a>,
        fabric: Fabric,
        reps: Vec<u32>,
        full: bool,
        external: Vec<Vec<u32>>,
        hook: Option<&'a mut dyn External>,
    ) -> Self {
        let layout = graph.layout;
        let mut insts = Vec::with_capacity(reps.len());
        let mut mailbox = 0u32;
        let mut remaining_ops = 0u64;
        let mut timelines = Vec::new();
        for &r in &reps {
            let prog = layout.coord(r).pp;
            let p = &graph.programs[prog as usize];
            let record = if opts.record_ranks.contains(&r) {
                timelines.push(RankTimeline {
                    rank: r,
                    ops: Vec::new(),
                });
                Some(timelines.len() - 1)
            } else {
                None
            };
            insts.push(Inst {
                rank: r,
                prog,
                pc: [0; NUM_STREAMS],
                busy: [false; NUM_STREAMS],
                sms: [0; NUM_STREAMS],
                started: [0; NUM_STREAMS],
                last_done: [0; NUM_STREAMS],
                mailbox,
                recv_wait: WAIT_NONE,
                last_compute_end: 0,
                timing: RankTiming {
                    rank: r,
                    ..RankTiming::default()
                },
                record,
                chain: Vec::new(),
                chain_gen: 0,
                chain_extra: 0,
                replan: false,
            });
            mailbox += p.recv_slots;
            remaining_ops += p.len() as u64;
        }
        let inst_of: Vec<u32> = if full {
            (0..layout.num_ranks()).collect()
        } else {
            // stage -> instance
            (0..layout.pp).collect()
        };
        let groups = GROUP_KINDS
            .iter()
            .map(|&k| {
                let count = if full {
                    layout.group_count(k) as usize
                } else {
                    0
                };
                GroupState {
                    arrived: vec![0; count],
                    start: vec![0; count],
                    size: if full { layout.group_size(k) } else { 1 },
                }
            })
            .collect();
        let shapes = GROUP_KINDS
            .iter()
            .map(|&k| vec![None; layout.group_count(k) as usize])
            .collect();
        let links_cache = per_group_slots(&layout, full);
        let wan_lat_cache = per_group_slots(&layout, full);
        let net = Network::new(fabric.capacity.clone());
        Sim {
            cluster,
            graph,
            layout,
            opts,
            comm: CommParams::default(),
            external,
            hook,
            pending: Vec::new(),
            starting: Vec::new(),
            replans: Vec::new(),
            hook_error: None,
            full,
            durations,
            contention: None,
            insts,
            inst_of,
            mail: vec![(NOT_YET, 0); mailbox as usize],
            groups,
            shapes,
            links_cache,
            send_links_cache: vec![None; 2 * layout.pp as usize],
            fabric,
            net,
            owners: Vec::new(),
            queue: EventQueue::new(),
            now: 0,
            events: 0,
            scratch_links: Vec::new(),
            members_scratch: Vec::new(),
            flow_ends: Vec::new(),
            timelines,
            remaining_ops,
            too_long: false,
            wan_lat_cache,
            turns: WanTurns::default(),
            wan_flows: Vec::new(),
            wan_done: Vec::new(),
            contended: vec![None; 2 * layout.pp as usize],
        }
    }

    fn push(&mut self, time: SimTime, ev: Event) {
        debug_assert!(time >= self.now);
        if time >= crate::units::TIME_LIMIT {
            // Beyond the time range: the run stops with `SimError::TooLong`.
            self.too_long = true;
            return;
        }
        self.queue.push(time, ev);
    }

    fn program(&self, inst: u32) -> &'a Program {
        &self.graph.programs[self.insts[inst as usize].prog as usize]
    }

    fn run(&mut self) -> Result<(), SimError> {
        for i in 0..self.insts.len() as u32 {
            self.advance(i, ((1u16 << NUM_STREAMS) - 1) as u8);
        }
        loop {
            // Durations of external compute are asked for, and rates recomputed, once per
            // instant, after everything else that happens at it.
            if self.queue.instant_done() {
                if !self.replans.is_empty() {
                    self.replan_chains();
                }
                if !self.starting.is_empty() {
                    self.start_chains();
                }
                if !self.pending.is_empty() {
                    self.resolve_pending()?;
                }
                if self.queue.instant_done() && self.net.needs_settle() {
                    self.settle();
                }
            }
            let Some((t, ev)) = self.queue.pop() else {
                break;
            };
            debug_assert!(t >= self.now);
            self.now = t;
            self.events += 1;
            self.handle(ev);
            if let Some(e) = self.hook_error.take() {
                return Err(e);
            }
        }
        if self.too_long {
            return Err(SimError::TooLong);
        }
        if self.remaining_ops != 0 {
            return Err(self.deadlock());
        }
        Ok(())
    }

    /// Prices the kernel chain of every compute op that started at this instant (in start
    /// order) and schedules its end, now that every event of the instant is done: a kernel
    /// starting at the instant a send ends, or a collective arrives, sees that stream's SMs as
    /// they are after the instant, whichever event came first. (The full and the reduced run
    /// order an instant's events differently.)
    fn start_chains(&mut self) {
        let mut starting = std::mem::take(&mut self.starting);
        for &(inst, op) in &starting {
            debug_assert!(self.insts[inst as usize].chain.is_empty());
            let end = self.plan_chain(inst, op, self.now);
            let generation = self.insts[inst as usize].chain_gen;
            self.push(end, Event::ChainDone { inst, generation });
        }
        starting.clear();
        self.starting = starting;
    }

    /// Re-prices, from this instant on, the chains in flight whose GPU saw an NCCL kernel
    /// start or end at it: each kernel is priced for the SMs held as it starts, fused or not.
    fn replan_chains(&mut self) {
        let now = self.now;
        let mut replans = std::mem::take(&mut self.replans);
        for &inst in &replans {
            let i = &mut self.insts[inst as usize];
            i.replan = false;
            let held = i.held_sms();
            if held == i.chain_extra {
                continue;
            }
            let Some(k) = i.chain.iter().position(|&(_, start, _)| start >= now) else {
                continue;
            };
            let (op, start, _) = i.chain[k];
            let old_last = *i.chain.last().expect("a chain in flight");
            i.chain.truncate(k);
            let end = self.plan_chain(inst, op, start);
            let i = &mut self.insts[inst as usize];
            // The chain's end event stands if the chain still ends with the same kernel then.
            if i.chain.last() != Some(&old_last) {
                i.chain_gen = i.chain_gen.wrapping_add(1);
                let generation = i.chain_gen;
                self.push(end, Event::ChainDone { inst, generation });
            }
        }
        replans.clear();
        self.replans = replans;
    }

    /// Asks the hook for the duration of every external compute op that started at this
    /// instant (in start order) and schedules its end. An instance standing for several external
    /// ranks takes the longest of their durations.
    fn resolve_pending(&mut self) -> Result<(), SimError> {
        let pending = std::mem::take(&mut self.pending);
        for &(inst, op) in &pending {
            let mut dur: SimTime = 0;
            for k in 0..self.external[inst as usize].len() {
                let rank = self.external[inst as usize][k];
                let hook = self
                    .hook
                    .as_deref_mut()
                    .expect("external instances have a hook");
                let d = hook
                    .compute_ps(rank, op, self.now)
                    .map_err(SimError::External)?;
                dur = dur.max(d);
            }
            let secs = dur as f64 * 1e-12;
            let p = self.program(inst);
            let i = &mut self.insts[inst as usize];
            i.timing.compute_s += secs;
            if let OpKind::Compute(c) = p.kind[op as usize]
                && c.class == OpClass::Gemm
            {
                i.timing.gemm_s += secs;
            }
            self.push(
                self.now.saturating_add(dur),
                Event::OpDone {
                    inst,
                    stream: Stream::Compute as u8,
                },
            );
        }
        self.pending = pending;
        self.pending.clear();
        Ok(())
    }

    fn settle(&mut self) {
        let mut ends = std::mem::take(&mut self.flow_ends);
        ends.clear();
        self.net.settle(self.now, &mut ends);
        for e in &ends {
            debug_assert!(e.time > self.now);
            self.push(
                e.time,
                Event::Flow {
                    flow: e.flow,
                    generation: e.generation,
                },
            );
        }
        self.flow_ends = ends;
    }

    fn deadlock(&self) -> SimError {
        for inst in &self.insts {
            let p = &self.graph.programs[inst.prog as usize];
            for s in 0..NUM_STREAMS {
                if (inst.pc[s] as usize) < p.stream_ops[s].len() {
                    let op = p.stream_ops[s][inst.pc[s] as usize];
                    return SimError::Deadlock {
                        rank: inst.rank,
                        stream: crate::graph::STREAMS[s].name(),
                        detail: format!("op {op} {:?}", p.kind[op as usize]),
                    };
                }
            }
        }
        SimError::Deadlock {
            rank: 0,
            stream: "?",
            detail: "unknown".into(),
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::OpDone { inst, stream } => {
                let mask = self.complete(inst, stream as usize, None);
                self.advance(inst, mask);
            }
            Event::ChainDone { inst, generation } => {
                if generation != self.insts[inst as usize].chain_gen {
                    return;
                }
                self.commit_chain(inst);
                let mask = self.complete(inst, Stream::Compute as usize, None);
                self.advance(inst, mask);
            }
            Event::CollDone { kind, id } => {
                let k = GROUP_KINDS[kind as usize];
                let stream = stream_of(k);
                if self.full {
                    let start = self.groups[kind as usize].start[id as usize];
                    let mut members = std::mem::take(&mut self.members_scratch);
                    members.clear();
                    members.extend(self.layout.members(k, id));
                    let mut mask = 0;
                    for &m in &members {
                        mask |= self.complete(m, stream, Some(start));
                    }
                    for &m in &members {
                        self.advance(m, mask);
                    }
                    self.members_scratch = members;
                } else {
                    let mask = self.complete(id, stream, None);
                    self.advance(id, mask);
                }
            }
            Event::SendDone { inst } => {
                self.deliver(inst);
                let mask = self.complete(inst, Stream::PpSend as usize, None);
                self.advance(inst, mask);
            }
            Event::Flow { flow, generation } => {
                let end = FlowEnd {
                    flow,
                    generation,
                    time: self.now,
                };
                if !self.net.is_current(&end) {
                    return;
                }
                self.net.finish(flow);
                if let Some((start, per_link)) =
                    self.wan_flows.get_mut(flow as usize).and_then(Option::take)
                {
                    // A reduced run's pipeline send in turns stands for every pipeline's
                    // transfer, one turn after another, each as long as this one.
                    let turns = if !self.full
                        && self
                            .turns
                            .owned
                            .get(flow as usize)
                            .is_some_and(|o| o.is_some())
                    {
                        self.layout.dp as u64
                    } else {
                        1
                    };
                    let d = self.now - start;
                    for (link, bytes) in per_link {
                        for k in 0..turns {
                            self.wan_done.push(WanTransfer {
                                link,
                                start: start + k * d,
                                end: start + (k + 1) * d,
                                bytes: bytes / turns,
                            });
                        }
                    }
                }
                if self
                    .turns
                    .owned
                    .get(flow as usize)
                    .is_some_and(|o| o.is_some())
                {
                    self.end_turn(flow);
                }
                let owner = self.owners[flow as usize].take().expect("flow owner");
                match owner {
                    Owner::Coll {
                        kind,
                        id,
                        min_end,
                        latency,
                    } => {
                        let t = self.now.max(min_end).saturating_add(latency);
                        self.push(t, Event::CollDone { kind, id });
                    }
                    Owner::Send {
                        inst,
                        min_end,
                        latency,
                    } => {
                        let t = self.now.max(min_end).saturating_add(latency);
                        self.push(t, Event::SendDone { inst });
                    }
                }
            }
            Event::WanFree => self.start_turns(),
        }
    }

    /// A pipeline send that owned WAN links ended: it gives them up (in a reduced run they
    /// stay taken for the other pipelines' turns, each as long as this one) and waiting sends
    /// get their turn.
    fn end_turn(&mut self, flow: FlowId) {
        let (wan, started, _) = self.turns.owned[flow as usize].take().expect("owned");
        let pipelines = if self.full { 1 } else { self.layout.dp };
        let lag = (pipelines as SimTime - 1).saturating_mul(self.now - started);
        self.turns.lag = self.turns.lag.max(lag);
        for l in wan {
            let g = self.turns.gates.get_mut(&l).expect("gate");
            g.1 -= 1;
            if g.1 == 0 {
                g.0 = None;
                g.2 = self.now.saturating_add(lag);
            }
        }
        self.push(self.now.saturating_add(lag), Event::WanFree);
    }

    /// Starts every waiting send whose WAN links are free for it, in arrival order; a send
    /// still waiting keeps its links from later sends (first come, first served).
    fn start_turns(&mut self) {
        let mut blocked: Vec<LinkId> = Vec::new();
        let mut i = 0;
        while i < self.turns.waiting.len() {
            let w = &self.turns.waiting[i];
            let free = w.wan.iter().all(|l| {
                !blocked.contains(l)
                    && self.turns.gates.get(l).is_none_or(|&(holder, _, until)| {
                        until <= self.now && holder.is_none_or(|h| h == w.tag)
                    })
            });
            if !free {
                blocked.extend_from_slice(&w.wan);
                i += 1;
                continue;
            }
            let w = self.turns.waiting.remove(i).expect("waiting send");
            for &l in &w.wan {
                let g = self.turns.gates.entry(l).or_insert((None, 0, 0));
                g.0 = Some(w.tag);
                g.1 += 1;
            }
            let f = self.add_flow(&w.links, w.plan, w.owner);
            if !self.full {
                // Every pipeline's bytes cross the link (one turn each).
                if let Some(Some((_, per_link))) = self.wan_flows.get_mut(f as usize) {
                    for (_, b) in per_link.iter_mut() {
                        *b *= self.layout.dp as u64;
                    }
                }
            }
            if self.turns.owned.len() <= f as usize {
                self.turns.owned.resize(f as usize + 1, None);
            }
            self.turns.owned[f as usize] = Some((w.wan, self.now, w.tag));
        }
    }

    /// Queues a pipeline send that crosses WAN links for its turn (temporal sharing). In a
    /// reduced run the flow stands for one pipeline's copies (the representative's), so its WAN
    /// counts are divided by the data-parallel degree.
    fn queue_turn(&mut self, rank: u32, mut links: Links, plan: CommPlan, owner: Owner) {
        let mut wan = Vec::new();
        for (l, c) in links.iter_mut() {
            if self.fabric.is_wan(*l) {
                wan.push(*l);
                if !self.full {
                    *c = c.div_ceil(self.layout.dp).max(1);
                }
            }
        }
        let tag = if self.full {
            self.layout.coord(rank).dp as u64
        } else {
            0
        };
        self.turns.waiting.push_back(Waiting {
            links,
            wan,
            plan,
            owner,
            tag,
        });
        self.start_turns();
    }

    /// Index of the send class of `rank`'s stage in direction `delta` (per stage: backward,
    /// forward) into [`Sim::send_links_cache`] and [`Sim::contended`], with the class's links
    /// (one representative pipeline's, with copy counts) computed on first use.
    fn send_class_key(&mut self, rank: u32, delta: i8) -> usize {
        let stage = self.layout.coord(rank).pp;
        let key = 2 * stage as usize + (delta > 0) as usize;
        if self.send_links_cache[key].is_none() {
            let mut links = Vec::new();
            class_links(
                &self.layout,
                &self.fabric,
                &FlowClass::Send { stage, delta },
                &mut links,
            );
            self.send_links_cache[key] = Some(links);
        }
        key
    }

    /// True when the WAN is what limits the sends of `rank`'s stage in direction `delta` if
    /// every copy (every pipeline) sends at once: its fair share per copy is below what the
    /// other links and the TCP cap allow. Only then do pipelines take turns; where the NICs
    /// are the bottleneck, turns would only serialise them.
    fn wan_contended(&mut self, rank: u32, delta: i8) -> bool {
        let key = self.send_class_key(rank, delta);
        if let Some(c) = self.contended[key] {
            return c;
        }
        let links = self.send_links_cache[key].as_ref().expect("filled");
        let share = |wan: bool| {
            links
                .iter()
                .filter(|&&(l, _)| self.fabric.is_wan(l) == wan)
                .map(|&(l, c)| self.fabric.capacity[l as usize] / c.max(1) as u64)
                .min()
                .unwrap_or(u64::MAX)
        };
        let c = share(true) < share(false).min(self.fabric.flow_cap(links));
        self.contended[key] = Some(c);
        c
    }

    /// Latency each step of a collective over `members` adds for the WAN: the longest one-way
    /// WAN latency between ring neighbours (any two members for an all-to-all), times the
    /// sequential steps of the algorithm (ring all-reduce `2 (n - 1)`, all-gather and
    /// reduce-scatter `n - 1`, all-to-all and a ring exchange 1).
    fn wan_collective_latency(&self, coll: comm::Collective, members: &[u32]) -> SimTime {
        let n = members.len();
        if n < 2 || !self.fabric.is_multi_dc() {
            return 0;
        }
        let (hop, steps) = if coll == comm::Collective::AllToAll {
            let mut firsts: Vec<u32> = Vec::new();
            for &m in members {
                if !firsts
                    .iter()
                    .any(|&f| self.fabric.dc(f) == self.fabric.dc(m))
                {
                    firsts.push(m);
                }
            }
            let mut hop = 0;
            for &a in &firsts {
                for &b in &firsts {
                    hop = hop.max(self.fabric.wan_latency_ps(a, b));
                }
            }
            (hop, 1)
        } else {
            let hop = (0..n)
                .map(|i| self.fabric.wan_latency_ps(members[i], members[(i + 1) % n]))
                .max()
                .unwrap_or(0);
            let steps = match coll {
                comm::Collective::AllReduce => 2 * (n - 1),
                comm::Collective::RingExchange => 1,
                _ => n - 1,
            };
            (hop, steps)
        };
        hop.saturating_mul(steps as SimTime)
    }

    /// Puts the message of `inst`'s current send into the receiver's mailbox.
    fn deliver(&mut self, inst: u32) {
        let p = self.program(inst);
        let i = &self.insts[inst as usize];
        let op = p.stream_ops[Stream::PpSend as usize][i.pc[Stream::PpSend as usize] as usize];
        let OpKind::Send { delta, slot, .. } = p.kind[op as usize] else {
            unreachable!("send op")
        };
        let sent_at = i.started[Stream::PpSend as usize];
        let peer = wrap_peer(&self.layout, i.rank, delta);
        let target = if self.full {
            self.inst_of[peer as usize]
        } else {
            self.inst_of[self.layout.coord(peer).pp as usize]
        };
        let t = &self.insts[target as usize];
        let idx = (t.mailbox + slot) as usize;
        debug_assert_eq!(self.mail[idx].0, NOT_YET, "mailbox slot filled twice");
        self.mail[idx] = (self.now, sent_at);
        if t.recv_wait == slot {
            self.insts[target as usize].recv_wait = WAIT_NONE;
            let mask = self.complete(target, Stream::PpRecv as usize, None);
            self.advance(target, mask);
        }
    }

    /// Marks the current op of `stream` done at `now`; returns the streams (bit mask) whose next
    /// op may have become ready.
    fn complete(&mut self, inst: u32, stream: usize, start: Option<SimTime>) -> u8 {
        let now = self.now;
        let p = self.program(inst);
        let i = &mut self.insts[inst as usize];
        debug_assert!(i.busy[stream] || stream == Stream::PpRecv as usize);
        let op = p.stream_ops[stream][i.pc[stream] as usize];
        let was_busy = std::mem::replace(&mut i.busy[stream], false);
        i.pc[stream] += 1;
        i.last_done[stream] = now;
        if stream == Stream::Compute as usize {
            i.last_compute_end = now;
        }
        if let Some(rec) = i.record {
            let s = start.unwrap_or(i.started[stream]).max(i.started[stream]);
            self.timelines[rec].ops.push(crate::engine::OpRecord {
                op,
                start: s.min(now),
                end: now,
            });
        }
        self.remaining_ops -= 1;
        if was_busy && stream != Stream::Compute as usize {
            self.sms_changed(inst, stream);
        }
        if stream != Stream::Compute as usize && !self.external[inst as usize].is_empty() {
            self.notify(inst, op);
        }
        // The stream itself and the streams of ops waiting on this one may move now.
        p.dependent_streams[op as usize] | (1 << stream)
    }

    /// Tells the hook that communication op `op` of external instance `inst` completed now.
    fn notify(&mut self, inst: u32, op: u32) {
        let now = self.now;
        for k in 0..self.external[inst as usize].len() {
            let rank = self.external[inst as usize][k];
            let hook = self
                .hook
                .as_deref_mut()
                .expect("external instances have a hook");
            if let Err(e) = hook.comm_done(rank, op, now) {
                self.hook_error.get_or_insert(SimError::External(e));
            }
        }
    }

    /// Starts every op of `inst` on the streams in `mask` that can start now.
    fn advance(&mut self, inst: u32, mut mask: u8) {
        let p = self.program(inst);
        while mask != 0 {
            let s = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            {
                let i = &self.insts[inst as usize];
                if i.busy[s] || i.pc[s] as usize >= p.stream_ops[s].len() {
                    continue;
                }
                let op = p.stream_ops[s][i.pc[s] as usize];
                let mut ready = true;
                let mut blocker: Option<usize> = None;
                for &d in p.deps_of(op) {
                    let ds = p.stream[d as usize] as usize;
                    if i.pc[ds] <= p.pos[d as usize] {
                        ready = false;
                        break;
                    }
                    if blocker.is_none_or(|b| i.last_done[ds] > i.last_done[b]) {
                        blocker = Some(ds);
                    }
                }
                if !ready {
                    continue;
                }
                if let Some(more) = self.start(inst, s, op, blocker) {
                    mask |= more;
                }
            }
        }
    }

    /// Starts `op` on stream `s`; when it completed at once, returns the streams to re-check.
    fn start(&mut self, inst: u32, s: usize, op: u32, blocker: Option<usize>) -> Option<u8> {
        let now = self.now;
        let p = self.program(inst);
        {
            let sms = self
                .contention
                .as_ref()
                .map_or(0, |c| c.op_sms(s, &p.kind[op as usize]));
            let i = &mut self.insts[inst as usize];
            i.busy[s] = true;
            i.sms[s] = sms;
            i.started[s] = now;
        }
        if s != Stream::Compute as usize {
            self.sms_changed(inst, s);
        }
        match p.kind[op as usize] {
            OpKind::Compute(_) if !self.external[inst as usize].is_empty() => {
                // Its duration comes from the hook once this instant is done.
                self.account_gap(inst, blocker, op);
                self.pending.push((inst, op));
                None
            }
            OpKind::Compute(_) => {
                // Priced once every event of this instant is done, so the SMs it finds held
                // do not depend on the order of the instant's events.
                self.account_gap(inst, blocker, op);
                self.starting.push((inst, op));
                None
            }
            OpKind::Collective {
                group,
                op: coll,
                bytes,
            } => {
                self.arrive(inst, group, coll, bytes);
                None
            }
            OpKind::Send { delta, bytes, .. } => {
                self.start_send(inst, delta, bytes);
                None
            }
            OpKind::Recv { slot } => {
                let idx = (self.insts[inst as usize].mailbox + slot) as usize;
                if self.mail[idx].0 != NOT_YET {
                    Some(self.complete(inst, s, None))
                } else {
                    self.insts[inst as usize].recv_wait = slot;
                    None
                }
            }
        }
    }

    /// Plans kernel `op`, starting at `start`, and, fused into the same event, every following
    /// kernel that would start the instant its predecessor ends: the predecessor has no
    /// dependents on other streams (nobody can observe its end) and the successor's
    /// dependencies are already met. The kernels are priced for the SMs NCCL holds now; when
    /// that changes before the chain ends, [`Sim::replan_chains`] re-prices the kernels not yet
    /// started. Exact: each kernel starts, at the price, when it would have in the unfused run.
    /// Returns the chain's end, whose completion is an event.
    fn plan_chain(&mut self, inst: u32, first: u32, start: SimTime) -> SimTime {
        let p = self.program(inst);
        let compute_ops = &p.stream_ops[Stream::Compute as usize];
        let prog = self.insts[inst as usize].prog;
        let durations = &self.durations[prog as usize];
        let i = &mut self.insts[inst as usize];
        // SMs the NCCL kernels in flight hold.
        let extra = i.held_sms();
        i.chain_extra = extra;
        let mut op = first;
        let mut start = start;
        loop {
            let base = match (extra, self.contention.as_mut(), p.kind[op as usize]) {
                (1.., Some(c), OpKind::Compute(k)) => c.duration(prog, op, &k, extra),
                _ => durations[op as usize],
            };
            let dur = match (self.opts.perturbation, p.kind[op as usize]) {
                (Some(pt), OpKind::Compute(c)) => {
                    let f = pt.kernel_factor(i.rank, op, c.class, c.name);
                    ((base as f64 * f).round().max(1.0)).min(crate::units::TIME_LIMIT as f64)
                        as SimTime
                }
                _ => base,
            };
            let end = start + dur;
            i.chain.push((op, start, end));
            let next_pos = p.pos[op as usize] as usize + 1;
            if p.has_dependents[op as usize] || next_pos >= compute_ops.len() || self.opts.unfused {
                break end;
            }
            let next = compute_ops[next_pos];
            // Earlier kernels are done or in this chain.
            let ready = p.deps_of(next).iter().all(|&d| {
                let ds = p.stream[d as usize] as usize;
                ds == Stream::Compute as usize || i.pc[ds] > p.pos[d as usize]
            });
            if !ready {
                break end;
            }
            op = next;
            start = end;
        }
    }

    /// The chain in flight of `inst` ended: its kernels are done (the last one completes as an
    /// op, the others were never observed).
    fn commit_chain(&mut self, inst: u32) {
        let p = self.program(inst);
        let i = &mut self.insts[inst as usize];
        let mut chain = std::mem::take(&mut i.chain);
        let (_, last_start, _) = *chain.last().expect("a chain in flight");
        for (k, &(op, start, end)) in chain.iter().enumerate() {
            let secs = (end - start) as f64 * 1e-12;
            i.timing.compute_s += secs;
            if let OpKind::Compute(c) = p.kind[op as usize]
                && c.class == OpClass::Gemm
            {
                i.timing.gemm_s += secs;
            }
            // The last kernel completes as an op (`complete`); the others end here.
            if k + 1 < chain.len() {
                i.pc[Stream::Compute as usize] += 1;
                self.remaining_ops -= 1;
                if let Some(rec) = i.record {
                    self.timelines[rec].ops.push(OpRecord { op, start, end });
                }
            }
        }
        i.started[Stream::Compute as usize] = last_start;
        chain.clear();
        i.chain = chain;
    }

    /// An NCCL kernel of `inst` started or ended on stream `s`: a chain in flight is re-priced
    /// once the instant is done.
    fn sms_changed(&mut self, inst: u32, s: usize) {
        let Some(c) = self.contention.as_ref() else {
            return;
        };
        let i = &mut self.insts[inst as usize];
        if c.sms[s] > 0 && !i.chain.is_empty() && !i.replan {
            i.replan = true;
            self.replans.push(inst);
        }
    }

    /// Attributes the compute stream's idle gap before `op` to what it waited for.
    fn account_gap(&mut self, inst: u32, blocker: Option<usize>, op: u32) {
        let now = self.now;
        let p = self.program(inst);
        let i = &mut self.insts[inst as usize];
        let gap = now.saturating_sub(i.last_compute_end);
        if gap == 0 {
            return;
        }
        let g = gap as f64 * 1e-12;
        let b = &mut i.timing.breakdown;
        match blocker.map(|s| crate::graph::STREAMS[s]) {
            Some(Stream::Tp) => b.tp_s += g,
            Some(Stream::Cp) => b.cp_s += g,
            Some(Stream::Ep) => b.ep_s += g,
            Some(Stream::Dp) => b.dp_s += g,
            Some(Stream::PpSend) => b.pp_s += g,
            Some(Stream::PpRecv) => {
                // The wait splits into the transfer itself (exposed PP communication) and the
                // time the sender was still computing (pipeline bubble).
                let recv_op = p
                    .deps_of(op)
                    .iter()
                    .copied()
                    .find(|&d| p.stream[d as usize] == Stream::PpRecv);
                let transfer = recv_op
                    .and_then(|r| match p.kind[r as usize] {
                        OpKind::Recv { slot } => Some(self.mail[(i.mailbox + slot) as usize]),
                        _ => None,
                    })
                    .map_or(0, |(arrive, sent)| {
                        arrive.saturating_sub(sent.max(i.last_compute_end))
                    });
                let t = transfer.min(gap);
                b.pp_s += t as f64 * 1e-12;
                b.bubble_s += (gap - t) as f64 * 1e-12;
            }
            Some(Stream::Compute) | None => b.bubble_s += g,
        }
    }

    fn shape(&mut self, kind: GroupKind, group: u32) -> GroupShape {
        let k = kind_index(kind);
        if let Some(s) = self.shapes[k][group as usize] {
            return s;
        }
        let s = group_shape(&self.layout, kind, group);
        self.shapes[k][group as usize] = Some(s);
        s
    }

    fn arrive(&mut self, inst: u32, kind: GroupKind, coll: comm::Collective, bytes: u64) {
        let rank = self.insts[inst as usize].rank;
        let group = self.layout.group_of(kind, rank);
        let k = kind_index(kind);
        let id = if self.full {
            let g = &mut self.groups[k];
            g.arrived[group as usize] += 1;
            if g.arrived[group as usize] < g.size {
                return;
            }
            g.arrived[group as usize] = 0;
            g.start[group as usize] = self.now;
            group
        } else {
            inst
        };
        let shape = self.shape(kind, group);
        let mut plan = comm::plan_collective(coll, bytes, shape, self.cluster, &self.comm);
        if kind == GroupKind::Ep && self.graph.ep_nic_scale < 1.0 && plan.nic_bytes > 0 {
            // Group-limited routing: each token crosses the network once per remote node; the
            // copies saved there are forwarded over NVLink inside the receiving node.
            let keep = (plan.nic_bytes as f64 * self.graph.ep_nic_scale).ceil() as u64;
            let moved = (plan.nic_bytes - keep) as f64;
            plan.nic_bytes = keep.max(1);
            plan.nvlink_ps += ps_from_s(moved / comm::nvlink_bytes_per_s(self.cluster, &self.comm));
        }
        let plan = self.congested(plan);
        if self.opts.ideal_network {
            self.push(self.now, Event::CollDone { kind: k as u8, id });
            return;
        }
        if plan.nic_bytes == 0 {
            self.push(
                self.now + plan.latency_ps + plan.nvlink_ps,
                Event::CollDone { kind: k as u8, id },
            );
            return;
        }
        // Links: the group's own (full) or those of all its symmetric copies (reduced).
        let key = if self.full {
            group as usize
        } else {
            self.layout.coord(rank).pp as usize
        };
        if self.links_cache[k][key].is_none() {
            let mut links = Vec::new();
            if self.full {
                let members: Vec<u32> = self.layout.members(kind, group).collect();
                group_links(&self.fabric, kind, &members, &mut links);
            } else {
                let stage = self.layout.coord(rank).pp;
                class_links(
                    &self.layout,
                    &self.fabric,
                    &FlowClass::Group { kind, stage },
                    &mut links,
                );
            }
            self.links_cache[k][key] = Some(links);
        }
        if self.wan_lat_cache[k][key].is_none() {
            let members: Vec<u32> = self.layout.members(kind, group).collect();
            self.wan_lat_cache[k][key] = Some(self.wan_collective_latency(coll, &members));
        }
        let wan_latency = self.wan_lat_cache[k][key].expect("cached");
        let links = self.links_cache[k][key].as_deref().expect("cached");
        let owner = Owner::Coll {
            kind: k as u8,
            id,
            min_end: self.now + plan.nvlink_ps,
            latency: plan.latency_ps.saturating_add(wan_latency),
        };
        self.add_flow(links.to_vec().as_slice(), plan, owner);
    }

    /// Applies this iteration's communication regime: every part of the plan takes `comm_factor`
    /// times as long (NIC bytes scaled, so contention still shares the slower transfer).
    fn congested(&self, mut plan: CommPlan) -> CommPlan {
        if let Some(p) = self.opts.perturbation
            && p.comm_factor() != 1.0
        {
            // Held at the time range (and bytes at as many), so that `now +` a scaled time
            // cannot wrap: an event past the range stops the run with `SimError::TooLong`.
            let f = p.comm_factor();
            let limit = crate::units::TIME_LIMIT as f64;
            let scale = |x: u64| (x as f64 * f).round().min(limit) as u64;
            plan.latency_ps = scale(plan.latency_ps);
            plan.nvlink_ps = scale(plan.nvlink_ps);
            plan.nic_bytes = scale(plan.nic_bytes).max(u64::from(plan.nic_bytes > 0));
        }
        plan
    }

    fn add_flow(&mut self, links: &[(LinkId, u32)], plan: CommPlan, owner: Owner) -> FlowId {
        let cap = self.fabric.flow_cap(links);
        let f = self.net.add_capped(
            self.now,
            links,
            self.fabric.flow_bytes(plan.nic_bytes),
            0,
            cap,
        );
        if self.owners.len() <= f as usize {
            self.owners.resize(f as usize + 1, None);
        }
        self.owners[f as usize] = Some(owner);
        if self.fabric.is_multi_dc() {
            let per_flow = self.fabric.flow_bytes(plan.nic_bytes);
            let per_link: Vec<(u32, u64)> = links
                .iter()
                .filter_map(|&(l, c)| self.fabric.wan_index(l).map(|i| (i, per_flow * c as u64)))
                .collect();
            if self.wan_flows.len() <= f as usize {
                self.wan_flows.resize(f as usize + 1, None);
            }
            self.wan_flows[f as usize] = (!per_link.is_empty()).then_some((self.now, per_link));
        }
        f
    }

    fn start_send(&mut self, inst: u32, delta: i8, bytes: u64) {
        let rank = self.insts[inst as usize].rank;
        let peer = wrap_peer(&self.layout, rank, delta);
        let same = self.fabric.same_node(rank, peer);
        let plan = self.congested(comm::plan_p2p(bytes, same, self.cluster, &self.comm));
        if self.opts.ideal_network {
            self.push(self.now, Event::SendDone { inst });
            return;
        }
        if plan.nic_bytes == 0 {
            self.push(
                self.now + plan.latency_ps + plan.nvlink_ps,
                Event::SendDone { inst },
            );
            return;
        }
        let owner = Owner::Send {
            inst,
            min_end: self.now,
            latency: plan
                .latency_ps
                .saturating_add(self.fabric.wan_latency_ps(rank, peer)),
        };
        let turns = self.fabric.wan_temporal()
            && self.fabric.dc(rank) != self.fabric.dc(peer)
            && self.wan_contended(rank, delta);
        if self.full {
            let mut links = std::mem::take(&mut self.scratch_links);
            links.clear();
            self.fabric.route(rank, peer, &mut links);
            if turns {
                self.queue_turn(rank, links.clone(), plan, owner);
            } else {
                self.add_flow(&links, plan, owner);
            }
            self.scratch_links = links;
        } else {
            let key = self.send_class_key(rank, delta);
            let links = self.send_links_cache[key].clone().expect("filled");
            if turns {
                self.queue_turn(rank, links, plan, owner);
            } else {
                self.add_flow(&links, plan, owner);
            }
        }
    }

    /// The iteration time (the last end of any instance) and every instance's timing, by rank.
    fn finish(&mut self) -> (SimTime, Vec<RankTiming>) {
        // Reduced runs with WAN turns: the last pipeline ends its turns behind the
        // representative (the first), by at most the longest lag.
        let iteration_ps = self
            .insts
            .iter()
            .map(|i| *i.last_done.iter().max().unwrap_or(&0))
            .max()
            .unwrap_or(0)
            .saturating_add(self.turns.lag);
        let mut ranks = Vec::with_capacity(self.insts.len());
        for i in &mut self.insts {
            let own_end = *i.last_done.iter().max().unwrap_or(&0);
            let tail_dp = own_end.saturating_sub(i.last_compute_end) as f64 * 1e-12;
            let tail_idle = iteration_ps.saturating_sub(own_end) as f64 * 1e-12;
            i.timing.breakdown.dp_s += tail_dp;
            i.timing.breakdown.bubble_s += tail_idle;
            i.timing.breakdown.compute_s = i.timing.compute_s;
            i.timing.finish_s = own_end as f64 * 1e-12;
            ranks.push(i.timing.clone());
        }
        ranks.sort_by_key(|r| r.rank);
        (iteration_ps, ranks)
    }
}

fn stream_of(kind: GroupKind) -> usize {
    (match kind {
        GroupKind::Tp => Stream::Tp,
        GroupKind::Cp => Stream::Cp,
        GroupKind::Ep => Stream::Ep,
        GroupKind::Dp | GroupKind::Edp => Stream::Dp,
    }) as usize
}
/// One empty cache slot per group of each kind: every group in a full run, one per pipeline
/// stage (the stage's representative group) in a reduced run.
fn per_group_slots<T: Clone>(layout: &Layout, full: bool) -> Vec<Vec<Option<T>>> {
    GROUP_KINDS
        .iter()
        .map(|&k| {
            let n = if full {
                layout.group_count(k) as usize
            } else {
                layout.pp as usize
            };
            vec![None; n]
        })
        .collect()
}
