//! Megatron-LM launch scripts -> Prism job files (`prism import megatron`).
//!
//! Reads the arguments of `pretrain_gpt.py` as a launch script passes them: a shell script with
//! variables (`NUM_LAYERS=32`, `${TP:-8}`, `$((GPUS_PER_NODE*NUM_NODES))`), argument arrays
//! (`MODEL_ARGS=( --num-layers 32 ... )`, `"--fp8-format hybrid"`), line continuations and
//! comments, or a plain command line. It is not a shell: it expands the script's own scalar
//! assignments in the order they appear (the last one wins, and a variable assigned two
//! different values is reported), and it reads every `--flag` in the text, whichever branch of
//! an `if` it sits in; a flag given two different values is an error naming both lines.
//!
//! Each argument Prism models becomes the job key with Megatron's meaning and default (e.g.
//! `--overlap-grad-reduce` is off unless given, embeddings are tied unless
//! `--untie-embeddings-and-output-weights`, dropout is 0.1 unless set to 0, the vocabulary is
//! padded to a multiple of `--make-vocab-size-divisible-by x tp` as Megatron pads it). Every
//! other `--flag` is listed in the job file as not used, and the arguments that change
//! performance but that Prism does not model are reported as such. The GPU type is not in the
//! arguments: the caller names a cluster preset.

use std::collections::{BTreeMap, BTreeSet};

use prism_core::job::CpCommType;

/// What the script does not say: the machine.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Cluster preset (`dgx-h100`, ...).
    pub cluster: String,
    /// Nodes; else the script's torchrun `--nnodes`.
    pub nodes: Option<u32>,
    /// GPUs per node; else torchrun's `--nproc_per_node`, else the preset's.
    pub gpus_per_node: Option<u32>,
    /// Script variables set by the caller (`NAME=VALUE`); they win over the script's own.
    pub vars: Vec<(String, String)>,
    /// Job name; else the script's file name.
    pub name: Option<String>,
    /// Megatron arguments added after the script's (`--vocab-size 151936`); they win over the
    /// script's values of the same arguments.
    pub extra_args: Vec<String>,
    /// The run's measured iteration time (from its log), written as the job's `[published]`
    /// figure so that `prism simulate` prints it beside the prediction.
    pub measured: Option<MeasuredTime>,
}

/// An iteration time read from a training log.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredTime {
    /// Median of the logged iteration times, seconds.
    pub iteration_time_s: f64,
    /// Log records the median is over.
    pub records: usize,
    /// Records skipped at the start (warm-up).
    pub skipped: usize,
    /// First and last iteration of the records used.
    pub iterations: (u64, u64),
    /// The log.
    pub origin: String,
}

/// The median iteration time of a Megatron-LM log (its `elapsed time per iteration (ms)` lines,
/// each an average over `--log-interval` iterations) or of a CSV timing log, after skipping the
/// first tenth of the records (at least one: the first holds the warm-up).
pub fn measured_iteration_time(
    text: &str,
    origin: &str,
) -> Result<MeasuredTime, crate::resilience::FormatError> {
    use prism_resilience::detect::LogEvent;
    let events = crate::resilience::parse_log(text, origin)?;
    let steps: Vec<(u64, f64)> = events
        .iter()
        .filter_map(|e| match e {
            LogEvent::Step(s) => Some((s.iteration, s.end_s - s.start_s)),
            _ => None,
        })
        .collect();
    let skipped = if steps.len() > 1 {
        (steps.len() / 10).max(1)
    } else {
        0
    };
    let used = &steps[skipped..];
    let mut times: Vec<f64> = used.iter().map(|s| s.1).collect();
    let (Some(median), Some(first), Some(last)) =
        (crate::kineto::median(&mut times), used.first(), used.last())
    else {
        return Err(crate::resilience::FormatError {
            origin: origin.to_string(),
            line: None,
            key: None,
            rule: "no iteration times in the log".into(),
        });
    };
    Ok(MeasuredTime {
        iteration_time_s: median,
        records: used.len(),
        skipped,
        iterations: (first.0, last.0),
        origin: origin.to_string(),
    })
}

/// A job file written from a script.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The job file (TOML), each key commented with the argument and line it came from.
    pub toml: String,
    /// `--flags` of the script that Prism does not use (optimizer, data, logging, ...).
    pub unused: Vec<String>,
    /// What the reader decided on the user's behalf or could not model, one line each.
    pub notes: Vec<String>,
}

/// A script Prism could not turn into a job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{origin}{}: {flag}: {rule}", line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct MegatronArgsError {
    /// The script.
    pub origin: String,
    /// 1-based line of the offending argument, when it has one.
    pub line: Option<usize>,
    /// The argument (or option) at fault, e.g. `--num-layers`.
    pub flag: String,
    /// What is wrong.
    pub rule: String,
}

/// How a Megatron argument is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arity {
    /// `store_true` / `store_false`: no value.
    Switch,
    /// One value.
    Value,
    /// One or more values (`nargs='+'`), kept joined by single spaces.
    Values,
}

/// The arguments Prism reads (Megatron-LM's `megatron/training/arguments.py` names) and
/// torchrun's node/GPU counts.
const READ: &[(&str, Arity)] = &[
    ("--num-layers", Arity::Value),
    ("--hidden-size", Arity::Value),
    ("--ffn-hidden-size", Arity::Value),
    ("--num-attention-heads", Arity::Value),
    ("--group-query-attention", Arity::Switch),
    ("--num-query-groups", Arity::Value),
    ("--kv-channels", Arity::Value),
    ("--seq-length", Arity::Value),
    ("--vocab-size", Arity::Value),
    ("--tokenizer-type", Arity::Value),
    ("--make-vocab-size-divisible-by", Arity::Value),
    ("--swiglu", Arity::Switch),
    ("--squared-relu", Arity::Switch),
    ("--untie-embeddings-and-output-weights", Arity::Switch),
    ("--attention-dropout", Arity::Value),
    ("--hidden-dropout", Arity::Value),
    ("--qk-layernorm", Arity::Switch),
    ("--num-experts", Arity::Value),
    ("--moe-router-topk", Arity::Value),
    ("--moe-ffn-hidden-size", Arity::Value),
    ("--moe-shared-expert-intermediate-size", Arity::Value),
    ("--moe-layer-freq", Arity::Value),
    ("--moe-router-num-groups", Arity::Value),
    ("--moe-router-group-topk", Arity::Value),
    ("--moe-token-dispatcher-type", Arity::Value),
    ("--multi-latent-attention", Arity::Switch),
    ("--q-lora-rank", Arity::Value),
    ("--kv-lora-rank", Arity::Value),
    ("--qk-head-dim", Arity::Value),
    ("--qk-pos-emb-head-dim", Arity::Value),
    ("--v-head-dim", Arity::Value),
    ("--mtp-num-layers", Arity::Value),
    ("--tensor-model-parallel-size", Arity::Value),
    ("--pipeline-model-parallel-size", Arity::Value),
    ("--context-parallel-size", Arity::Value),
    ("--cp-comm-type", Arity::Values),
    ("--window-size", Arity::Value),
    ("--window-attn-skip-freq", Arity::Value),
    ("--moe-expert-capacity-factor", Arity::Value),
    ("--moe-pad-expert-input-to-capacity", Arity::Switch),
    ("--expert-model-parallel-size", Arity::Value),
    ("--num-layers-per-virtual-pipeline-stage", Arity::Value),
    ("--num-virtual-stages-per-pipeline-rank", Arity::Value),
    ("--virtual-pipeline-model-parallel-size", Arity::Value),
    ("--pipeline-model-parallel-layout", Arity::Value),
    ("--decoder-first-pipeline-num-layers", Arity::Value),
    ("--decoder-last-pipeline-num-layers", Arity::Value),
    ("--account-for-embedding-in-pipeline-split", Arity::Switch),
    ("--account-for-loss-in-pipeline-split", Arity::Switch),
    ("--sequence-parallel", Arity::Switch),
    ("--micro-batch-size", Arity::Value),
    ("--global-batch-size", Arity::Value),
    ("--recompute-activations", Arity::Switch),
    ("--recompute-granularity", Arity::Value),
    ("--recompute-method", Arity::Value),
    ("--recompute-num-layers", Arity::Value),
    ("--use-distributed-optimizer", Arity::Switch),
    ("--overlap-grad-reduce", Arity::Switch),
    ("--overlap-param-gather", Arity::Switch),
    ("--tp-comm-overlap", Arity::Switch),
    ("--grad-reduce-in-bf16", Arity::Switch),
    ("--accumulate-allreduce-grads-in-fp32", Arity::Switch),
    ("--no-gradient-accumulation-fusion", Arity::Switch),
    ("--no-overlap-p2p-communication", Arity::Switch),
    ("--overlap-p2p-communication-warmup-flush", Arity::Switch),
    ("--no-align-grad-reduce", Arity::Switch),
    ("--ddp-bucket-size", Arity::Value),
    ("--use-tp-pp-dp-mapping", Arity::Switch),
    ("--overlap-moe-expert-parallel-comm", Arity::Switch),
    ("--bf16", Arity::Switch),
    ("--fp16", Arity::Switch),
    ("--fp8-format", Arity::Value),
    ("--fp8-param-gather", Arity::Switch),
    ("--fp8-recipe", Arity::Value),
    ("--use-precision-aware-optimizer", Arity::Switch),
    ("--main-params-dtype", Arity::Value),
    ("--main-grads-dtype", Arity::Value),
    ("--exp-avg-dtype", Arity::Value),
    ("--exp-avg-sq-dtype", Arity::Value),
    ("--use-flash-attn", Arity::Switch),
    ("--attention-backend", Arity::Value),
    ("--cross-entropy-loss-fusion", Arity::Switch),
    ("--cross-entropy-fusion-impl", Arity::Value),
    // torchrun (both spellings).
    ("--nnodes", Arity::Value),
    ("--nproc_per_node", Arity::Value),
    ("--nproc-per-node", Arity::Value),
];

/// Arguments that change the time or memory of a step but that this reader does not turn into
/// job keys, with why.
const NOT_MODELLED: &[(&str, &str)] = &[
    (
        "--expert-tensor-parallel-size",
        "expert tensor parallelism is not modelled (experts use the job's tp)",
    ),
    (
        "--cpu-offloading",
        "activation / weight offloading to the host is not modelled",
    ),
    (
        "--optimizer-cpu-offload",
        "optimizer offloading to the host is not modelled",
    ),
    (
        "--recompute-modules",
        "per-module recomputation is not read (recompute is none, selective or full)",
    ),
    (
        "--enable-cuda-graph",
        "CUDA graphs (no host launch cost) are not modelled",
    ),
    (
        "--external-cuda-graph",
        "CUDA graphs (no host launch cost) are not modelled",
    ),
    (
        "--use-torch-fsdp2",
        "FSDP2 is not read from a Megatron script (set parallel.zero_stage = 3)",
    ),
    (
        "--use-megatron-fsdp",
        "Megatron-FSDP is not read from a Megatron script (set parallel.zero_stage = 3)",
    ),
];

/// What Megatron-Core's precision-aware optimizer arguments say.
#[derive(Clone, Copy, Debug, Default)]
struct OptimDtypes {
    /// `--use-precision-aware-optimizer`.
    aware: bool,
    /// `--main-grads-dtype bf16`: gradients accumulated and reduced in BF16.
    main_grads_bf16: bool,
    /// `--main-params-dtype fp16`: a 16-bit master copy (not modelled; noted).
    main_params_16: bool,
    /// Both Adam moments in 16 bits (`--exp-avg-dtype`, `--exp-avg-sq-dtype`).
    state_bf16: bool,
}

/// Megatron-Core's precision-aware optimizer (`--use-precision-aware-optimizer`, Transformer
/// Engine's FusedAdam) and the dtypes it allows; without it OptimizerConfig refuses any of
/// them but FP32, and so does this reader.
fn precision_aware_optimizer(r: &mut Reader) -> Result<OptimDtypes, MegatronArgsError> {
    let aware = r.has("--use-precision-aware-optimizer");
    let dtype = |flag: &'static str, allowed: &[&str]| -> Result<u8, MegatronArgsError> {
        let Some(v) = r.str(flag) else {
            return Ok(4);
        };
        let bytes = match v {
            "fp32" => 4,
            "fp16" | "bf16" => 2,
            "fp8" => 1,
            _ => 0,
        };
        if bytes == 0 || !allowed.contains(&v) {
            return Err(r.err(
                flag,
                r.line(flag),
                format!("`{v}` is not one of {}", allowed.join(", ")),
            ));
        }
        if bytes != 4 && !aware {
            return Err(r.err(
                flag,
                r.line(flag),
                format!(
                    "`{v}` needs --use-precision-aware-optimizer (Megatron-Core's OptimizerConfig \
                     allows only fp32 without it)"
                ),
            ));
        }
        Ok(bytes)
    };
    let grads = dtype("--main-grads-dtype", &["fp32", "bf16"])?;
    let params = dtype("--main-params-dtype", &["fp32", "fp16"])?;
    let avg = dtype("--exp-avg-dtype", &["fp32", "fp16", "bf16", "fp8"])?;
    let avg_sq = dtype("--exp-avg-sq-dtype", &["fp32", "fp16", "bf16", "fp8"])?;
    if params == 2 {
        r.notes.push(
            "--main-params-dtype fp16: an FP16 master copy is not modelled; Prism keeps FP32 \
             master weights (4 bytes per parameter)"
                .into(),
        );
    }
    if avg != avg_sq || avg == 1 {
        r.notes.push(format!(
            "--exp-avg-dtype / --exp-avg-sq-dtype: Prism keeps both Adam moments in one type; \
             they are counted as {}",
            if avg.max(avg_sq) == 4 {
                "FP32 (4 bytes each)"
            } else {
                "16-bit (2 bytes each)"
            }
        ));
    }
    Ok(OptimDtypes {
        aware,
        main_grads_bf16: grads == 2,
        main_params_16: params == 2,
        state_bf16: avg.max(avg_sq) <= 2,
    })
}

/// An `if` being read: whether the current branch runs (`None`: its test could not be
/// evaluated) and whether an earlier branch ran.
#[derive(Clone, Copy, Debug)]
struct Branch {
    now: Option<bool>,
    taken: bool,
}

/// The value of an `if` / `elif` line's test, when it is made of `[[ A == B ]]`, `[ A = B ]`,
/// `!=`, `-z A`, `-n A` and integer comparisons joined by `&&` and `||` (left to right, as
/// bash), over words with no unexpanded variables; `None` otherwise.
fn condition(line: &str) -> Option<bool> {
    let body = line.trim_start();
    let body = body
        .strip_prefix("elif")
        .or_else(|| body.strip_prefix("if"))?
        .trim();
    let body = body
        .rsplit_once("then")
        .map(|(c, _)| c)
        .unwrap_or(body)
        .trim()
        .trim_end_matches(';')
        .trim();
    // Split at && / || (outside brackets the tests have none of their own).
    let mut value: Option<bool> = None;
    let mut op = "";
    let mut rest = body;
    loop {
        let next = [("&&", rest.find("&&")), ("||", rest.find("||"))]
            .into_iter()
            .filter_map(|(o, p)| p.map(|p| (o, p)))
            .min_by_key(|&(_, p)| p);
        let (atom, following) = match next {
            Some((o, p)) => (&rest[..p], Some((o, &rest[p + 2..]))),
            None => (rest, None),
        };
        let v = test(atom.trim())?;
        value = Some(match (op, value) {
            ("&&", Some(a)) => a && v,
            ("||", Some(a)) => a || v,
            _ => v,
        });
        match following {
            Some((o, r)) => {
                op = o;
                rest = r;
            }
            None => return value,
        }
    }
}

/// One `[[ ... ]]` / `[ ... ]` test.
fn test(atom: &str) -> Option<bool> {
    let inner = atom
        .strip_prefix("[[")
        .and_then(|a| a.strip_suffix("]]"))
        .or_else(|| atom.strip_prefix('[').and_then(|a| a.strip_suffix(']')))?;
    let ws = shlex::split(inner)?;
    if ws.iter().any(|w| w.contains('$')) {
        return None;
    }
    let num = |w: &str| w.parse::<i64>().ok();
    match ws.as_slice() {
        [op, a] if op == "-z" => Some(a.is_empty()),
        [op, a] if op == "-n" => Some(!a.is_empty()),
        [a, op, b] => match op.as_str() {
            "==" | "=" => Some(a == b),
            "!=" => Some(a != b),
            "-eq" => Some(num(a)? == num(b)?),
            "-ne" => Some(num(a)? != num(b)?),
            "-gt" => Some(num(a)? > num(b)?),
            "-lt" => Some(num(a)? < num(b)?),
            "-ge" => Some(num(a)? >= num(b)?),
            "-le" => Some(num(a)? <= num(b)?),
            _ => None,
        },
        _ => None,
    }
}

/// One occurrence of a read argument.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) value: Option<String>,
    pub(crate) line: usize,
    /// Where it was read, when not a `--flag` of the script (a NeMo config key such as
    /// `model.num_layers: 80`); the job file's comment names this instead.
    pub(crate) from: Option<String>,
}

/// What the arguments were read from: the wording of comments and errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// A Megatron-LM launch script or command line (`prism import megatron`).
    Script,
    /// A NeMo training config (YAML; `prism import nemo`), translated to Megatron's arguments.
    NemoConfig,
}

/// Lines of `text` with backslash continuations joined, each with its first line's number.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    for (i, raw) in text.lines().enumerate() {
        if cur.is_empty() {
            start = i + 1;
        }
        let trimmed = raw.trim_end();
        if let Some(body) = trimmed.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
        } else {
            cur.push_str(trimmed);
            out.push((start, std::mem::take(&mut cur)));
        }
    }
    if !cur.is_empty() {
        out.push((start, cur));
    }
    out
}

/// Integer arithmetic of `$(( ))`: `+ - * / %` and parentheses over names already expanded.
fn arith(expr: &str) -> Option<i64> {
    struct P<'a> {
        s: &'a [u8],
        i: usize,
    }
    impl P<'_> {
        fn ws(&mut self) {
            while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
                self.i += 1;
            }
        }
        /// Binary operators by precedence level: 0 `+ -`, 1 `* / %`, 2 an atom.
        fn expr(&mut self, level: u8) -> Option<i64> {
            if level == 2 {
                return self.atom();
            }
            let mut v = self.expr(level + 1)?;
            loop {
                self.ws();
                let op = match (level, self.s.get(self.i)) {
                    (0, Some(&c)) if c == b'+' || c == b'-' => c,
                    (1, Some(&c)) if c == b'*' || c == b'/' || c == b'%' => c,
                    _ => return Some(v),
                };
                self.i += 1;
                let r = self.expr(level + 1)?;
                v = match op {
                    b'+' => v.checked_add(r),
                    b'-' => v.checked_sub(r),
                    b'*' => v.checked_mul(r),
                    b'/' => v.checked_div(r),
                    _ => v.checked_rem(r),
                }?;
            }
        }
        fn atom(&mut self) -> Option<i64> {
            self.ws();
            match self.s.get(self.i)? {
                b'(' => {
                    self.i += 1;
                    let v = self.expr(0)?;
                    self.ws();
                    (self.s.get(self.i) == Some(&b')')).then_some(())?;
                    self.i += 1;
                    Some(v)
                }
                b'-' => {
                    self.i += 1;
                    self.atom()?.checked_neg()
                }
                c if c.is_ascii_digit() => {
                    let st = self.i;
                    while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                        self.i += 1;
                    }
                    std::str::from_utf8(&self.s[st..self.i]).ok()?.parse().ok()
                }
                _ => None,
            }
        }
    }
    let mut p = P {
        s: expr.as_bytes(),
        i: 0,
    };
    let v = p.expr(0)?;
    p.ws();
    (p.i == p.s.len()).then_some(v)
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands `$NAME`, `${NAME}`, `${NAME:-default}` (and `-`, `:=`, `=`), `${1:-default}`,
/// `$(( arithmetic ))` and drops `${ARRAY[@]}` (arrays are read where they are written).
/// Unknown names are left as written, so that an argument's value names them.
fn expand(s: &str, vars: &BTreeMap<String, String>) -> String {
    let cs: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < cs.len() {
        if cs[i] != '$' || i + 1 >= cs.len() {
            out.push(cs[i]);
            i += 1;
            continue;
        }
        // $(( ... ))
        if cs[i + 1] == '(' && cs.get(i + 2) == Some(&'(') {
            let mut depth = 0i32;
            let mut j = i + 1;
            while j < cs.len() {
                match cs[j] {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            if j < cs.len() && j >= i + 4 {
                let inner: String = cs[i + 3..j - 1].iter().collect();
                // Names inside $(( )) may be bare.
                let mut e = expand(&inner, vars);
                for (k, v) in vars.iter().rev() {
                    e = replace_word(&e, k, v);
                }
                if let Some(v) = arith(&e) {
                    out.push_str(&v.to_string());
                    i = j + 1;
                    continue;
                }
            }
            out.push(cs[i]);
            i += 1;
            continue;
        }
        if cs[i + 1] == '{' {
            let Some(close) = cs[i + 2..].iter().position(|&c| c == '}') else {
                out.push(cs[i]);
                i += 1;
                continue;
            };
            let inner: String = cs[i + 2..i + 2 + close].iter().collect();
            let end = i + 2 + close + 1;
            let name_len = inner.chars().take_while(|&c| is_name_char(c)).count();
            let (name, rest) = inner.split_at(name_len);
            if rest.starts_with('[') {
                // ${ARR[@]}: the array's words are read where the array is written.
                i = end;
                continue;
            }
            let default = ["", ":-", "-", ":=", "="]
                .iter()
                .skip(1)
                .find_map(|op| rest.strip_prefix(op));
            match (vars.get(name), default) {
                (Some(v), _) if !(v.is_empty() && rest.starts_with(':')) => out.push_str(v),
                (_, Some(d)) => out.push_str(&expand(strip_quotes(d), vars)),
                _ => out.extend(&cs[i..end]),
            }
            i = end;
            continue;
        }
        if is_name_start(cs[i + 1]) {
            let mut j = i + 1;
            while j < cs.len() && is_name_char(cs[j]) {
                j += 1;
            }
            let name: String = cs[i + 1..j].iter().collect();
            match vars.get(&name) {
                Some(v) => out.push_str(v),
                None => out.extend(&cs[i..j]),
            }
            i = j;
            continue;
        }
        out.push(cs[i]);
        i += 1;
    }
    out
}

/// `s` with whole-word occurrences of `name` replaced by `value` (for bare names in `$(( ))`).
fn replace_word(s: &str, name: &str, value: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(p) = rest.find(name) {
        let before_ok = rest[..p].chars().last().is_none_or(|c| !is_name_char(c));
        let after = &rest[p + name.len()..];
        let after_ok = after.chars().next().is_none_or(|c| !is_name_char(c));
        out.push_str(&rest[..p]);
        out.push_str(if before_ok && after_ok { value } else { name });
        rest = after;
    }
    out.push_str(rest);
    out
}

fn strip_quotes(s: &str) -> &str {
    let t = s.trim();
    for q in ['"', '\''] {
        if let Some(inner) = t.strip_prefix(q).and_then(|x| x.strip_suffix(q)) {
            return inner;
        }
    }
    t
}

/// `NAME=value` (optionally after `export`, `local`, `readonly`, `declare`): the name and the
/// raw value text, for scalar assignments (not arrays).
fn assignment(line: &str) -> Option<(&str, &str)> {
    let mut t = line.trim_start();
    for kw in ["export ", "local ", "readonly ", "declare "] {
        if let Some(r) = t.strip_prefix(kw) {
            t = r.trim_start();
        }
    }
    let name_len = t.chars().take_while(|&c| is_name_char(c)).count();
    if name_len == 0 || !t.starts_with(is_name_start) {
        return None;
    }
    let (name, rest) = t.split_at(name_len);
    let value = rest.strip_prefix('=')?;
    if value.starts_with('(') {
        return None;
    }
    Some((name, value))
}

/// The words of a line as the shell would split them (quotes removed, a `#` comment dropped),
/// with quoted words that hold several `--flags` (array elements such as `"--fp8-format
/// hybrid"`) split again at whitespace.
fn words(line: &str) -> Vec<String> {
    let mut lex = shlex::Shlex::new(line);
    let mut ws: Vec<String> = lex.by_ref().collect();
    if lex.had_error {
        // Unbalanced quotes: fall back to whitespace, quotes stripped.
        ws = line
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .map(|w| w.trim_matches(|c| c == '"' || c == '\'').to_string())
            .collect();
    }
    let mut out = Vec::with_capacity(ws.len());
    for w in ws {
        // A quoted word holding arguments (`OPTIONS=" --num-layers 32 ..."`, an array element
        // `"--fp8-format hybrid"`) is split again at whitespace.
        if w.contains(char::is_whitespace)
            && (w.trim_start().starts_with("--") || w.contains(" --"))
        {
            out.extend(w.split_whitespace().map(str::to_string));
        } else if w == "(" || w == ")" {
            // Array parentheses are syntax, not words.
        } else if let Some((name, rest)) = w.split_once("=(") {
            // `ARGS=(--num-layers`: the assignment, then the array's first word.
            out.push(format!("{name}="));
            let rest = rest.strip_suffix(')').unwrap_or(rest);
            if !rest.is_empty() {
                out.push(rest.to_string());
            }
        } else if w.ends_with(')') && !w.contains('(') {
            // `32)`: an array's last word.
            out.push(w.trim_end_matches(')').to_string());
        } else {
            out.push(w);
        }
    }
    out
}

pub(crate) struct Reader<'a> {
    origin: &'a str,
    dialect: Dialect,
    pub(crate) seen: BTreeMap<&'static str, Seen>,
    pub(crate) unused: BTreeSet<String>,
    pub(crate) notes: Vec<String>,
    /// For a translated config: the config key each Megatron argument stands for (errors name
    /// the key the user wrote).
    pub(crate) names: BTreeMap<&'static str, &'static str>,
    /// For a translated config: switches the config turns off explicitly, with where
    /// (`model.sequence_parallel: False (line 30)`).
    pub(crate) off: BTreeMap<&'static str, String>,
    /// Job keys the translation sets beyond what the Megatron arguments say:
    /// (section, key, value, why).
    pub(crate) extra_keys: Vec<(&'static str, &'static str, toml::Value, String)>,
    /// Variables: the caller's (`fixed`, they win) and the script's, in order (a translated
    /// config's `env_vars` too).
    pub(crate) vars: BTreeMap<String, String>,
    fixed: BTreeMap<String, String>,
    /// Each script variable's last value and line.
    assigned: BTreeMap<String, (String, usize)>,
}

impl<'a> Reader<'a> {
    /// A reader of `origin` whose variables `vars` are fixed (they win over the script's).
    pub(crate) fn new(origin: &'a str, vars: BTreeMap<String, String>) -> Self {
        Reader {
            origin,
            dialect: Dialect::Script,
            seen: BTreeMap::new(),
            unused: BTreeSet::new(),
            notes: Vec::new(),
            names: BTreeMap::new(),
            off: BTreeMap::new(),
            extra_keys: Vec::new(),
            fixed: vars.clone(),
            vars,
            assigned: BTreeMap::new(),
        }
    }

    /// A reader of a translated NeMo config.
    pub(crate) fn nemo(origin: &'a str) -> Self {
        Reader {
            dialect: Dialect::NemoConfig,
            ..Reader::new(origin, BTreeMap::new())
        }
    }

    pub(crate) fn err(
        &self,
        flag: &str,
        line: Option<usize>,
        rule: impl Into<String>,
    ) -> MegatronArgsError {
        MegatronArgsError {
            origin: self.origin.to_string(),
            line,
            flag: self.names.get(flag).copied().unwrap_or(flag).to_string(),
            rule: rule.into(),
        }
    }

    fn has(&self, flag: &str) -> bool {
        self.seen.contains_key(flag)
    }

    fn line(&self, flag: &str) -> Option<usize> {
        self.seen.get(flag).map(|s| s.line)
    }

    fn str(&self, flag: &str) -> Option<&str> {
        self.seen.get(flag).and_then(|s| s.value.as_deref())
    }

    fn num<T: std::str::FromStr>(&self, flag: &str) -> Result<Option<T>, MegatronArgsError> {
        let Some(v) = self.str(flag) else {
            return Ok(None);
        };
        v.parse::<T>().map(Some).map_err(|_| {
            let rule = if v.contains('$') && self.dialect == Dialect::NemoConfig {
                format!("`{v}` could not be resolved (give the value with --override KEY=VALUE)")
            } else if v.contains('$') {
                format!("`{v}` is not set in the script (set the variable with --var NAME=VALUE)")
            } else {
                format!("`{v}` is not a valid number")
            };
            self.err(flag, self.line(flag), rule)
        })
    }

    fn req<T: std::str::FromStr>(&self, flag: &str) -> Result<T, MegatronArgsError> {
        self.num(flag)?.ok_or_else(|| {
            self.err(
                flag,
                None,
                match self.dialect {
                    Dialect::Script => {
                        "not found in the script (Megatron requires it; pass it in the script or \
                         with --var)"
                    }
                    Dialect::NemoConfig => {
                        "not found in the config (NeMo requires it; add it to the file or give it \
                         with --override KEY=VALUE)"
                    }
                },
            )
        })
    }
}

/// One `key = value` line of the job file, commented with its source.
pub(crate) struct Out {
    sections: BTreeMap<&'static str, Vec<String>>,
}

impl Out {
    /// `key = value` read from Megatron argument `flag` (or its default).
    fn put_arg(
        &mut self,
        r: &Reader,
        section: &'static str,
        key: &str,
        value: toml::Value,
        flag: &str,
    ) {
        self.put(section, key, value, &src(r, flag));
    }

    fn put(&mut self, section: &'static str, key: &str, value: toml::Value, why: &str) {
        let v = value.to_string();
        let line = if why.is_empty() {
            format!("{key} = {v}")
        } else {
            format!("{key} = {v}  # {why}")
        };
        self.sections.entry(section).or_default().push(line);
    }
}

fn src(r: &Reader, flag: &str) -> String {
    if let Some(Seen {
        from: Some(from),
        line,
        ..
    }) = r.seen.get(flag)
    {
        return if *line > 0 {
            format!("{from} (line {line})")
        } else {
            from.clone()
        };
    }
    if r.dialect == Dialect::NemoConfig {
        if let Some(off) = r.off.get(flag) {
            return off.clone();
        }
        let key = r.names.get(flag).copied().unwrap_or(flag);
        return format!("NeMo's default (no {key})");
    }
    match r.seen.get(flag) {
        Some(Seen {
            value: Some(v),
            line: 0,
            ..
        }) => format!("{flag} {v} (--arg)"),
        Some(Seen {
            value: None,
            line: 0,
            ..
        }) => format!("{flag} (--arg)"),
        Some(Seen {
            value: Some(v),
            line,
            ..
        }) => format!("{flag} {v} (line {line})"),
        Some(Seen {
            value: None, line, ..
        }) => format!("{flag} (line {line})"),
        None => format!("Megatron's default (no {flag})"),
    }
}

/// Megatron's padded vocabulary: `orig` rounded up to a multiple of `divisible_by x tp`
/// (`_vocab_size_with_padding` in `megatron/training/tokenizer/tokenizer.py`).
pub fn padded_vocab(orig: u32, divisible_by: u32, tp: u32) -> u32 {
    let m = u64::from(divisible_by.max(1)) * u64::from(tp.max(1));
    let p = u64::from(orig).div_ceil(m) * m;
    u32::try_from(p).unwrap_or(u32::MAX)
}

/// Reads a Megatron-LM launch script (or command line) into a Prism job file.
pub fn import_megatron(
    text: &str,
    origin: &str,
    opts: &ImportOptions,
) -> Result<Imported, MegatronArgsError> {
    let mut r = Reader::new(origin, opts.vars.iter().cloned().collect());
    // `if` / `elif` / `else` / `fi`: branches whose test can be evaluated are followed; a branch
    // whose test cannot (a file test, an unset variable) is read as if taken.
    let mut branches: Vec<Branch> = Vec::new();
    for (line_no, line) in logical_lines(text) {
        let trimmed = line.trim_start();
        if trimmed.starts_with('#') {
            continue;
        }
        let first = trimmed.split_whitespace().next().unwrap_or("");
        let first = first.trim_end_matches(';');
        let skipping = branches.iter().any(|b| b.now == Some(false));
        // `if [ ... ]; then A; else B; fi` on one line.
        let one_line = (first == "if").then(|| one_line_if(trimmed)).flatten();
        match first {
            "if" if one_line.is_some() => {
                if skipping {
                    continue;
                }
                let (cond, then_part, else_part) = one_line.unwrap_or_default();
                let cond = condition(&expand(&cond, &r.vars));
                if cond != Some(false) {
                    r.statements(&then_part, line_no)?;
                }
                if cond != Some(true) {
                    r.statements(&else_part, line_no)?;
                }
                continue;
            }
            "if" | "elif" => {
                let cond = condition(&expand(trimmed, &r.vars));
                if first == "if" {
                    branches.push(Branch {
                        now: cond,
                        taken: cond == Some(true),
                    });
                } else if let Some(b) = branches.last_mut() {
                    b.now = if b.taken { Some(false) } else { cond };
                    b.taken |= cond == Some(true);
                }
                continue;
            }
            "else" => {
                if let Some(b) = branches.last_mut() {
                    b.now = if b.taken {
                        Some(false)
                    } else if b.now.is_none() {
                        None
                    } else {
                        Some(true)
                    };
                }
                if branches.iter().any(|b| b.now == Some(false)) {
                    continue;
                }
                // `else X=1` on one line: read the rest.
                let rest = trimmed["else".len()..].trim_start_matches(';').trim();
                r.statements(rest, line_no)?;
                continue;
            }
            "fi" => {
                branches.pop();
                continue;
            }
            _ => {}
        }
        if skipping {
            continue;
        }
        r.statements(trimmed, line_no)?;
    }
    // The caller's arguments replace the script's.
    let mut extra = Reader::new("--arg", r.vars.clone());
    for (i, a) in opts.extra_args.iter().enumerate() {
        extra.flags(a, i + 1)?;
    }
    for (name, seen) in extra.seen {
        r.seen.insert(
            name,
            Seen {
                value: seen.value,
                line: 0,
                from: None,
            },
        );
    }
    r.unused.extend(extra.unused);
    build(r, opts, origin)
}

/// True when `value` still refers to a positional parameter (`$1`, `${2}`, `$@`, `$*`).
fn positional(value: &str) -> bool {
    let b = value.as_bytes();
    b.windows(2)
        .any(|w| w[0] == b'$' && (w[1].is_ascii_digit() || w[1] == b'@' || w[1] == b'*'))
        || b.windows(3)
            .any(|w| w[0] == b'$' && w[1] == b'{' && (w[2].is_ascii_digit() || w[2] == b'@'))
}

/// `if COND; then A; else B; fi` on one line: (COND with its `if`, A, B).
fn one_line_if(line: &str) -> Option<(String, String, String)> {
    let body = line.trim_end().trim_end_matches(';').trim_end();
    let body = body.strip_suffix("fi")?;
    if !body.ends_with([';', ' ']) {
        return None;
    }
    let (cond, rest) = body.split_once("then")?;
    let (then_part, else_part) = match rest.split_once("else") {
        Some((t, e)) => (t, e),
        None => (rest, ""),
    };
    Some((
        cond.trim().trim_end_matches(';').to_string(),
        then_part.to_string(),
        else_part.to_string(),
    ))
}

impl Reader<'_> {
    /// Reads one line's statements (`;`-separated outside quotes is approximated by splitting
    /// at `; ` for one-line `if` bodies): records assignments, then reads the `--flags`.
    fn statements(&mut self, text: &str, line_no: usize) -> Result<(), MegatronArgsError> {
        for stmt in text.split("; ") {
            self.statement(stmt.trim().trim_end_matches(';'), line_no)?;
        }
        Ok(())
    }

    fn statement(&mut self, stmt: &str, line_no: usize) -> Result<(), MegatronArgsError> {
        // An assignment's value may itself hold flags (DATA_ARGS="--data-path ..."): after
        // recording it, the line is read for flags too.
        if let Some((name, raw)) = assignment(stmt)
            && !self.fixed.contains_key(name)
        {
            let expanded = expand(raw, &self.vars);
            // The value is the first shell word, quotes removed (a quoted list of arguments
            // stays one value, to be expanded where it is used).
            let value = shlex::Shlex::new(&expanded).next().unwrap_or_default();
            // The script is read as if run without arguments: an assignment from a positional
            // parameter (an argument-parsing `case` arm) does not run.
            if positional(&value) {
                return self.flags(stmt, line_no);
            }
            if let Some((old, old_line)) = self.assigned.get(name)
                && *old != value
            {
                self.notes.push(format!(
                    "{name} is assigned {old:?} (line {old_line}) and {value:?} (line \
                     {line_no}); the last is used"
                ));
            }
            self.assigned
                .insert(name.to_string(), (value.clone(), line_no));
            self.vars.insert(name.to_string(), value);
        }
        self.flags(stmt, line_no)
    }

    /// Reads the `--flags` of one statement.
    fn flags(&mut self, stmt: &str, line_no: usize) -> Result<(), MegatronArgsError> {
        let ws = words(&expand(stmt, &self.vars));
        let mut i = 0;
        while i < ws.len() {
            let w = &ws[i];
            i += 1;
            let Some(body) = w.strip_prefix("--") else {
                continue;
            };
            if body.is_empty() {
                continue;
            }
            let (flag, inline) = match w.split_once('=') {
                Some((f, v)) => (f.to_string(), Some(v.to_string())),
                None => (w.clone(), None),
            };
            let Some(&(name, arity)) = READ.iter().find(|(n, _)| *n == flag) else {
                self.unused.insert(flag);
                continue;
            };
            let value = match arity {
                Arity::Switch => None,
                Arity::Value | Arity::Values => match inline {
                    Some(v) => Some(v),
                    None => match ws.get(i) {
                        Some(v) if !v.starts_with("--") => {
                            i += 1;
                            let mut v = v.clone();
                            // More values are plain words: not the next flag, nor a shell
                            // redirection or pipe (`2>&1 | tee log`) after the last one.
                            let plain = |w: &&String| {
                                !w.starts_with("--")
                                    && w.chars()
                                        .all(|c| c.is_ascii_alphanumeric() || "_+.-".contains(c))
                            };
                            while arity == Arity::Values
                                && let Some(more) = ws.get(i).filter(plain)
                            {
                                v.push(' ');
                                v.push_str(more);
                                i += 1;
                            }
                            Some(v)
                        }
                        _ => {
                            return Err(self.err(name, Some(line_no), "expects a value"));
                        }
                    },
                },
            };
            if let Some(prev) = self.seen.get(name)
                && prev.value != value
            {
                return Err(self.err(
                    name,
                    Some(line_no),
                    format!(
                        "given {} on line {} and {} here; keep one (or choose with --var)",
                        prev.value.as_deref().unwrap_or("(switch)"),
                        prev.line,
                        value.as_deref().unwrap_or("(switch)")
                    ),
                ));
            }
            self.seen.insert(
                name,
                Seen {
                    value,
                    line: line_no,
                    from: None,
                },
            );
        }
        Ok(())
    }
}

/// Writes the job file of the arguments `r` has read (a script's, or a config's translated to
/// Megatron's names).
pub(crate) fn build(
    mut r: Reader,
    opts: &ImportOptions,
    origin: &str,
) -> Result<Imported, MegatronArgsError> {
    let mut out = Out {
        sections: BTreeMap::new(),
    };
    let int = |v: u32| toml::Value::Integer(i64::from(v));
    let s = |v: &str| toml::Value::String(v.to_string());
    let b = toml::Value::Boolean;

    // Parallel sizes first: the vocabulary padding needs tp.
    let tp: u32 = r.num("--tensor-model-parallel-size")?.unwrap_or(1);
    let pp: u32 = r.num("--pipeline-model-parallel-size")?.unwrap_or(1);
    let cp: u32 = r.num("--context-parallel-size")?.unwrap_or(1);
    let ep: u32 = r.num("--expert-model-parallel-size")?.unwrap_or(1);

    // Model.
    for flag in ["--hybrid-override-pattern", "--hybrid-layer-pattern"] {
        if r.unused.contains(flag) {
            return Err(r.err(
                flag,
                None,
                "a hybrid Mamba model: Mamba (state-space) layers are not modelled",
            ));
        }
    }
    if r.unused.contains("--encoder-num-layers") {
        return Err(r.err(
            "--encoder-num-layers",
            None,
            "an encoder-decoder model (T5): encoder-decoder models are not modelled",
        ));
    }
    let layers: u32 = r.req("--num-layers")?;
    let hidden: u32 = r.req("--hidden-size")?;
    let heads: u32 = r.req("--num-attention-heads")?;
    let seq: u32 = r.req("--seq-length")?;
    out.put_arg(&r, "model", "layers", int(layers), "--num-layers");
    out.put_arg(&r, "model", "hidden", int(hidden), "--hidden-size");
    let swiglu = r.has("--swiglu");
    let ffn = match r.num::<u32>("--ffn-hidden-size")? {
        Some(f) => f,
        // Megatron's defaults: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64.
        None if swiglu => (4 * u64::from(hidden) * 2 / 3 / 64 * 64) as u32,
        None => hidden.saturating_mul(4),
    };
    out.put_arg(&r, "model", "ffn_hidden", int(ffn), "--ffn-hidden-size");
    out.put_arg(&r, "model", "heads", int(heads), "--num-attention-heads");
    let kv = if r.has("--group-query-attention") {
        r.num::<u32>("--num-query-groups")?.unwrap_or(1)
    } else {
        heads
    };
    out.put(
        "model",
        "kv_heads",
        int(kv),
        &if r.has("--group-query-attention") {
            src(&r, "--num-query-groups")
        } else if r.dialect == Dialect::NemoConfig {
            "NeMo's default (no model.num_query_groups): one group per head".to_string()
        } else {
            "no --group-query-attention: one group per head".to_string()
        },
    );
    if let Some(d) = r.num::<u32>("--kv-channels")? {
        out.put_arg(&r, "model", "head_dim", int(d), "--kv-channels");
    }
    out.put_arg(&r, "model", "seq_len", int(seq), "--seq-length");
    // Vocabulary: what the tokenizer gives, padded as Megatron pads it.
    let tokenizer = r.str("--tokenizer-type").unwrap_or("GPT2BPETokenizer");
    let given: Option<u32> = r.num("--vocab-size")?;
    let (orig, why) = match (tokenizer, given) {
        // The null tokenizer adds an end-of-document token after the vocabulary.
        ("NullTokenizer", Some(v)) => (
            v.saturating_add(1),
            format!("{} + 1 (NullTokenizer's EOD)", v),
        ),
        (_, Some(v)) => (
            v,
            match r.seen.get("--vocab-size").and_then(|s| s.from.clone()) {
                Some(from) => from,
                None => format!("--vocab-size {v}"),
            },
        ),
        ("GPT2BPETokenizer", None) => (50257, "GPT-2 BPE, 50,257 tokens".to_string()),
        ("Llama2Tokenizer", None) => (32000, "Llama 2's 32,000 tokens".to_string()),
        (t, None) => {
            return Err(r.err(
                "--vocab-size",
                r.line("--tokenizer-type"),
                format!(
                    "the vocabulary of tokenizer `{t}` is not in the script; add --vocab-size \
                     (to the script, or as --arg '--vocab-size N')"
                ),
            ));
        }
    };
    let divisible: u32 = r.num("--make-vocab-size-divisible-by")?.unwrap_or(128);
    let vocab = padded_vocab(orig, divisible, tp);
    out.put(
        "model",
        "vocab",
        int(vocab),
        &format!("{why}, padded to a multiple of {divisible} x tp {tp} as Megatron pads it"),
    );
    let activation = if swiglu { "swiglu" } else { "gelu" };
    out.put(
        "model",
        "activation",
        s(activation),
        &if swiglu {
            src(&r, "--swiglu")
        } else if r.has("--squared-relu") {
            format!("{}: a plain two-matrix MLP", src(&r, "--squared-relu"))
        } else if r.has("--activation") {
            format!("{}: a two-matrix MLP", src(&r, "--activation"))
        } else if r.dialect == Dialect::NemoConfig {
            "NeMo's default (no model.activation): GeLU".to_string()
        } else {
            "no --swiglu: Megatron's GeLU MLP".to_string()
        },
    );
    let untied = r.has("--untie-embeddings-and-output-weights");
    out.put_arg(
        &r,
        "model",
        "tied_embeddings",
        b(!untied),
        "--untie-embeddings-and-output-weights",
    );
    let ad: f64 = r.num("--attention-dropout")?.unwrap_or(0.1);
    let hd: f64 = r.num("--hidden-dropout")?.unwrap_or(0.1);
    out.put(
        "model",
        "dropout",
        b(ad > 0.0 || hd > 0.0),
        &match r.dialect {
            Dialect::Script => format!(
                "--attention-dropout {ad}, --hidden-dropout {hd} (Megatron: 0.1 each when not \
                 given)"
            ),
            Dialect::NemoConfig => format!(
                "model.attention_dropout {ad}, model.hidden_dropout {hd} (NeMo: 0.1 each when \
                 not given)"
            ),
        },
    );
    if r.has("--qk-layernorm") {
        out.put_arg(&r, "model", "qk_norm", b(true), "--qk-layernorm");
    }
    if let Some(e) = r.num::<u32>("--num-experts")?.filter(|&e| e > 0) {
        out.put_arg(&r, "model", "moe_experts", int(e), "--num-experts");
        let k: u32 = r.num("--moe-router-topk")?.unwrap_or(2);
        out.put_arg(&r, "model", "moe_top_k", int(k), "--moe-router-topk");
        let f: u32 = r.num("--moe-ffn-hidden-size")?.unwrap_or(ffn);
        out.put_arg(
            &r,
            "model",
            "moe_ffn_hidden",
            int(f),
            "--moe-ffn-hidden-size",
        );
        if let Some(sh) = r.num::<u32>("--moe-shared-expert-intermediate-size")? {
            out.put_arg(
                &r,
                "model",
                "moe_shared_ffn_hidden",
                int(sh),
                "--moe-shared-expert-intermediate-size",
            );
        }
        if let Some(freq) = r.str("--moe-layer-freq") {
            let (dense, step) = moe_layer_freq(freq).ok_or_else(|| {
                r.err(
                    "--moe-layer-freq",
                    r.line("--moe-layer-freq"),
                    format!(
                        "`{freq}` is not modelled: Prism reads an integer step or \
                         `([0]*K+[1]*N)` (K leading dense layers, then MoE on every layer)"
                    ),
                )
            })?;
            if dense > 0 {
                out.put_arg(
                    &r,
                    "model",
                    "moe_first_dense_layers",
                    int(dense),
                    "--moe-layer-freq",
                );
            }
            if step > 1 {
                out.put_arg(&r, "model", "moe_layer_step", int(step), "--moe-layer-freq");
            }
        }
        if let (Some(g), Some(t)) = (
            r.num::<u32>("--moe-router-num-groups")?,
            r.num::<u32>("--moe-router-group-topk")?,
        ) && g > 1
            && t < g
        {
            out.put_arg(&r, "model", "moe_groups", int(g), "--moe-router-num-groups");
            out.put_arg(
                &r,
                "model",
                "moe_groups_per_token",
                int(t),
                "--moe-router-group-topk",
            );
        }
        if let Some(cf) = r.num::<f64>("--moe-expert-capacity-factor")? {
            if r.has("--moe-pad-expert-input-to-capacity") {
                // Every expert computes and exchanges exactly its capacity.
                out.put_arg(
                    &r,
                    "model",
                    "moe_capacity_factor",
                    toml::Value::Float(cf),
                    "--moe-expert-capacity-factor",
                );
            } else {
                r.notes.push(format!(
                    "--moe-expert-capacity-factor {cf} without \
                     --moe-pad-expert-input-to-capacity: an expert drops the tokens beyond its \
                     capacity, so none computes more than {cf} x its share; the job is priced \
                     dropless (model.moe_imbalance, default balanced)"
                ));
            }
        }
    }
    // Sliding-window attention (Megatron-Core's `is_layer_window_attention`): `(left, right)`
    // as Transformer Engine's window, on every layer but each `--window-attn-skip-freq`-th.
    if let Some(w) = r.str("--window-size") {
        let bad = |rule: String| r.err("--window-size", r.line("--window-size"), rule);
        let parts: Vec<&str> = w
            .trim_matches(|c| c == '(' || c == ')')
            .split(',')
            .collect();
        let [left, right] = parts[..] else {
            return Err(bad(format!("`{w}` is not a pair `(left,right)`")));
        };
        let (Ok(left), Ok(right)) = (left.trim().parse::<i64>(), right.trim().parse::<i64>())
        else {
            return Err(bad(format!("`{w}` is not a pair of integers")));
        };
        if right != 0 {
            return Err(bad(format!(
                "`{w}`: a window that looks {right} tokens ahead is not modelled (causal windows \
                 `(left,0)` only)"
            )));
        }
        if left >= 0 {
            // A query sees itself and `left` keys before it: HF's `sliding_window` of left + 1.
            let window = left
                .checked_add(1)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| bad(format!("`{w}`: the window is too large")))?;
            out.put_arg(
                &r,
                "model",
                "attention_window",
                int(window),
                "--window-size",
            );
            if let Some(freq) = r.str("--window-attn-skip-freq") {
                let every: u32 = freq.parse().map_err(|_| {
                    r.err(
                        "--window-attn-skip-freq",
                        r.line("--window-attn-skip-freq"),
                        format!(
                            "`{freq}` is not modelled: Prism reads an integer N (every N-th \
                             layer attends to the whole sequence)"
                        ),
                    )
                })?;
                out.put_arg(
                    &r,
                    "model",
                    "attention_global_every",
                    int(every),
                    "--window-attn-skip-freq",
                );
            }
        }
    }
    if r.has("--multi-latent-attention") {
        // Megatron's MLA defaults (arguments.py).
        for (flag, key, default) in [
            ("--q-lora-rank", "mla_q_lora_rank", 0u32),
            ("--kv-lora-rank", "mla_kv_lora_rank", 32),
            ("--qk-head-dim", "mla_qk_nope_head_dim", 128),
            ("--qk-pos-emb-head-dim", "mla_qk_rope_head_dim", 64),
            ("--v-head-dim", "mla_v_head_dim", 128),
        ] {
            let v: u32 = r.num(flag)?.unwrap_or(default);
            out.put_arg(&r, "model", key, int(v), flag);
        }
    }
    if let Some(m) = r.num::<u32>("--mtp-num-layers")? {
        out.put_arg(&r, "model", "mtp_depth", int(m), "--mtp-num-layers");
    }

    // Cluster.
    let preset = crate::presets::cluster_preset(&opts.cluster).ok_or_else(|| {
        r.err(
            "--cluster",
            None,
            format!(
                "unknown cluster preset `{}`; known: {}",
                opts.cluster,
                crate::presets::cluster_preset_names().join(", ")
            ),
        )
    })?;
    out.put("cluster", "preset", s(&opts.cluster), "");
    let nodes = match opts.nodes {
        Some(n) => n,
        None => r.num::<u32>("--nnodes")?.ok_or_else(|| {
            r.err(
                "--nodes",
                None,
                match r.dialect {
                    Dialect::Script => {
                        "the script gives no node count (torchrun --nnodes); pass --nodes"
                    }
                    Dialect::NemoConfig => "the config gives no trainer.num_nodes; pass --nodes",
                },
            )
        })?,
    };
    out.put(
        "cluster",
        "nodes",
        int(nodes),
        &if opts.nodes.is_some() {
            "--nodes".to_string()
        } else {
            src(&r, "--nnodes")
        },
    );
    let preset_gpn = toml::from_str::<toml::Table>(preset)
        .ok()
        .and_then(|t| t.get("gpus_per_node").and_then(|v| v.as_integer()))
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(8);
    let script_gpn = match r.num::<u32>("--nproc_per_node")? {
        Some(g) => Some(g),
        None => r.num::<u32>("--nproc-per-node")?,
    };
    let gpn = opts.gpus_per_node.or(script_gpn).unwrap_or(preset_gpn);
    if gpn != preset_gpn {
        let why = if opts.gpus_per_node.is_some() {
            "--gpus-per-node".to_string()
        } else if r.dialect == Dialect::NemoConfig {
            src(&r, "--nproc_per_node")
        } else {
            "torchrun --nproc_per_node".to_string()
        };
        out.put("cluster", "gpus_per_node", int(gpn), &why);
    }

    // Parallel layout.
    out.put_arg(
        &r,
        "parallel",
        "tp",
        int(tp),
        "--tensor-model-parallel-size",
    );
    out.put_arg(
        &r,
        "parallel",
        "pp",
        int(pp),
        "--pipeline-model-parallel-size",
    );
    if cp > 1 {
        out.put_arg(&r, "parallel", "cp", int(cp), "--context-parallel-size");
    }
    if ep > 1 {
        out.put_arg(
            &r,
            "parallel",
            "ep",
            int(ep),
            "--expert-model-parallel-size",
        );
    }
    if let Some(n) = r.num::<u32>("--num-layers-per-virtual-pipeline-stage")? {
        out.put_arg(
            &r,
            "parallel",
            "num_layers_per_virtual_pipeline_stage",
            int(n),
            "--num-layers-per-virtual-pipeline-stage",
        );
    }
    for flag in [
        "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size",
    ] {
        if let Some(v) = r.num::<u32>(flag)? {
            out.put_arg(&r, "parallel", "vpp", int(v), flag);
            break;
        }
    }
    if let Some(l) = r.str("--pipeline-model-parallel-layout") {
        out.put(
            "parallel",
            "pipeline_layout",
            s(l),
            &format!(
                "--pipeline-model-parallel-layout (line {})",
                r.line("--pipeline-model-parallel-layout").unwrap_or(0)
            ),
        );
    }
    for (flag, key) in [
        ("--decoder-first-pipeline-num-layers", "first_stage_layers"),
        ("--decoder-last-pipeline-num-layers", "last_stage_layers"),
    ] {
        if let Some(v) = r.num::<u32>(flag)? {
            out.put_arg(&r, "parallel", key, int(v), flag);
        }
    }
    for (flag, key) in [
        (
            "--account-for-embedding-in-pipeline-split",
            "account_for_embedding_in_pipeline_split",
        ),
        (
            "--account-for-loss-in-pipeline-split",
            "account_for_loss_in_pipeline_split",
        ),
        ("--use-tp-pp-dp-mapping", "use_tp_pp_dp_mapping"),
        (
            "--overlap-moe-expert-parallel-comm",
            "overlap_moe_expert_parallel_comm",
        ),
        ("--fp8-param-gather", "fp8_param_gather"),
    ] {
        if r.has(flag) {
            out.put_arg(&r, "parallel", key, b(true), flag);
        }
    }
    let micro: u32 = r.req("--micro-batch-size")?;
    out.put_arg(
        &r,
        "parallel",
        "micro_batch",
        int(micro),
        "--micro-batch-size",
    );
    // Megatron's switches are off unless given (Prism's stack defaults differ: set them all).
    for (flag, key) in [
        ("--sequence-parallel", "sequence_parallel"),
        ("--use-distributed-optimizer", "distributed_optimizer"),
        ("--overlap-grad-reduce", "overlap_grad_reduce"),
        ("--overlap-param-gather", "overlap_param_gather"),
        ("--tp-comm-overlap", "tp_comm_overlap"),
    ] {
        out.put_arg(&r, "parallel", key, b(r.has(flag)), flag);
    }
    let optim = precision_aware_optimizer(&mut r)?;
    // Megatron reduces BF16 gradients in FP32 unless --grad-reduce-in-bf16, and FP16 gradients
    // in FP16 unless --accumulate-allreduce-grads-in-fp32.
    if r.has("--fp16") && !r.has("--bf16") {
        let fp32 = r.has("--accumulate-allreduce-grads-in-fp32");
        out.put(
            "parallel",
            "grad_reduce_in_bf16",
            b(!fp32),
            &if fp32 {
                src(&r, "--accumulate-allreduce-grads-in-fp32")
            } else {
                "--fp16 without --accumulate-allreduce-grads-in-fp32: 16-bit gradients".into()
            },
        );
    } else if optim.main_grads_bf16 {
        out.put_arg(
            &r,
            "parallel",
            "grad_reduce_in_bf16",
            b(true),
            "--main-grads-dtype",
        );
    } else {
        out.put_arg(
            &r,
            "parallel",
            "grad_reduce_in_bf16",
            b(r.has("--grad-reduce-in-bf16")),
            "--grad-reduce-in-bf16",
        );
    }
    for (flag, key) in [
        (
            "--no-gradient-accumulation-fusion",
            "gradient_accumulation_fusion",
        ),
        ("--no-overlap-p2p-communication", "overlap_p2p_comm"),
        ("--no-align-grad-reduce", "align_grad_reduce"),
    ] {
        if r.has(flag) {
            out.put_arg(&r, "parallel", key, b(false), flag);
        }
    }
    if r.has("--overlap-p2p-communication-warmup-flush") {
        out.put_arg(
            &r,
            "parallel",
            "overlap_p2p_comm_warmup_flush",
            b(true),
            "--overlap-p2p-communication-warmup-flush",
        );
    }
    if let Some(bytes) = r.num::<f64>("--ddp-bucket-size")? {
        out.put_arg(
            &r,
            "parallel",
            "dp_bucket_mparams",
            toml::Value::Float(bytes / 1e6),
            "--ddp-bucket-size",
        );
    }
    if let Some(d) = r.str("--moe-token-dispatcher-type") {
        let v = match d {
            "flex" => "deepep",
            "alltoall" | "alltoall_seq" | "allgather" => "alltoall",
            other => {
                return Err(r.err(
                    "--moe-token-dispatcher-type",
                    r.line("--moe-token-dispatcher-type"),
                    format!("`{other}` is not modelled (alltoall, allgather or flex)"),
                ));
            }
        };
        out.put_arg(
            &r,
            "parallel",
            "moe_dispatcher",
            s(v),
            "--moe-token-dispatcher-type",
        );
    }
    // Recomputation.
    let granularity = r
        .str("--recompute-granularity")
        .map(str::to_string)
        .or_else(|| r.has("--recompute-activations").then(|| "selective".into()));
    let recompute = match granularity.as_deref() {
        None => "none",
        Some("selective") => "selective",
        Some("full") => {
            let method = r.str("--recompute-method").unwrap_or("uniform");
            let n: u32 = r.num("--recompute-num-layers")?.unwrap_or(1);
            let per_stage = layers / pp.max(1);
            if method == "block" && n < per_stage {
                r.notes.push(format!(
                    "--recompute-method block --recompute-num-layers {n}: Prism recomputes every \
                     layer (full), not {n} of the {per_stage} per stage; the prediction is slower \
                     than the run"
                ));
            }
            "full"
        }
        Some(other) => {
            return Err(r.err(
                "--recompute-granularity",
                r.line("--recompute-granularity"),
                format!("`{other}` is not one of full, selective"),
            ));
        }
    };
    out.put(
        "parallel",
        "recompute",
        s(recompute),
        &if r.has("--recompute-granularity") {
            src(&r, "--recompute-granularity")
        } else {
            src(&r, "--recompute-activations")
        },
    );

    // Training.
    let world = u64::from(nodes) * u64::from(gpn);
    let model_parallel = u64::from(tp) * u64::from(pp) * u64::from(cp);
    let global = match r.num::<u32>("--global-batch-size")? {
        Some(g) => g,
        None => {
            // Megatron's default: one micro-batch per data-parallel rank.
            if model_parallel == 0 || world % model_parallel != 0 {
                return Err(r.err(
                    "--global-batch-size",
                    None,
                    format!(
                        "not given, and {world} GPUs do not divide by tp x pp x cp = \
                         {model_parallel} to derive it"
                    ),
                ));
            }
            u32::try_from(world / model_parallel * u64::from(micro)).unwrap_or(u32::MAX)
        }
    };
    out.put_arg(
        &r,
        "training",
        "global_batch",
        int(global),
        "--global-batch-size",
    );
    let precision = if r.has("--fp8-format") {
        "fp8"
    } else if r.has("--bf16") {
        "bf16"
    } else if r.has("--fp16") {
        "fp16"
    } else {
        return Err(r.err(
            "--bf16",
            None,
            "neither --bf16, --fp16 nor --fp8-format: Megatron would train in FP32, which Prism \
             does not model",
        ));
    };
    out.put(
        "training",
        "precision",
        s(precision),
        &if precision == "fp8" {
            src(&r, "--fp8-format")
        } else {
            src(
                &r,
                if precision == "bf16" {
                    "--bf16"
                } else {
                    "--fp16"
                },
            )
        },
    );
    // Megatron-Core keeps FP32 master weights itself under FP8 recipes other than delayed
    // scaling (`use_precision_aware_optimizer_no_fp8_or_ds_fp8` in OptimizerConfig).
    let mut fp32_masters_kept = false;
    if precision == "fp8" {
        match r.str("--fp8-recipe") {
            None | Some("delayed") => {}
            Some("tensorwise") => fp32_masters_kept = true,
            Some(recipe @ ("blockwise" | "mxfp8")) => {
                fp32_masters_kept = true;
                out.put_arg(&r, "training", "fp8_recipe", s(recipe), "--fp8-recipe");
            }
            Some(other) => {
                return Err(r.err(
                    "--fp8-recipe",
                    r.line("--fp8-recipe"),
                    format!(
                        "`{other}` is not a recipe Prism models (delayed, tensorwise, blockwise, \
                         mxfp8)"
                    ),
                ));
            }
        }
    }
    if optim.state_bf16 {
        out.put(
            "training",
            "optimizer_state_dtype",
            s("bf16"),
            &src(&r, "--exp-avg-dtype"),
        );
    }
    // Transformer Engine's FusedAdam keeps the master weights as remainders beside BF16
    // weights, unless Megatron-Core keeps FP32 masters itself (above) or the weights are FP8.
    if optim.aware
        && !optim.main_params_16
        && r.has("--bf16")
        && !r.has("--fp8-param-gather")
        && !fp32_masters_kept
    {
        out.put(
            "training",
            "master_weight_remainders",
            b(true),
            &format!(
                "{}: Transformer Engine's FusedAdam stores the FP32 master weights' low 16 bits \
                 (store_param_remainders, on since Megatron-Core of February 2025 with TE 2.1)",
                src(&r, "--use-precision-aware-optimizer")
            ),
        );
    }
    if let Some(list) = r.str("--cp-comm-type") {
        // One type for every layer, or one per layer (Megatron's nargs='+'); Transformer
        // Engine's spellings are the job file's.
        let mut types = list.split(' ');
        let t = types.next().unwrap_or_default();
        if types.any(|other| other != t) {
            return Err(r.err(
                "--cp-comm-type",
                r.line("--cp-comm-type"),
                format!("`{list}`: a different communication type per layer is not modelled"),
            ));
        }
        if !CpCommType::NAMES.iter().any(|(name, _)| *name == t) {
            let rule = if t == "a2a+p2p" {
                "`a2a+p2p` (hierarchical context parallelism, \
                 --hierarchical-context-parallel-sizes) is not modelled (p2p, all_gather or a2a)"
                    .to_string()
            } else {
                format!("`{t}` is not modelled (p2p, all_gather or a2a)")
            };
            return Err(r.err("--cp-comm-type", r.line("--cp-comm-type"), rule));
        }
        out.put_arg(&r, "parallel", "cp_comm_type", s(t), "--cp-comm-type");
    }
    // Fused cross entropy: Megatron-Core's own kernels unless --cross-entropy-fusion-impl te.
    // The implementation is checked whether or not the fusion is on, as Megatron's argparse
    // `choices` does.
    let imp = r.str("--cross-entropy-fusion-impl").unwrap_or("native");
    if !matches!(imp, "native" | "te") {
        return Err(r.err(
            "--cross-entropy-fusion-impl",
            r.line("--cross-entropy-fusion-impl"),
            format!("`{imp}` is not one of Megatron's choices (native or te)"),
        ));
    }
    if r.has("--cross-entropy-loss-fusion") {
        out.put_arg(
            &r,
            "training",
            "cross_entropy_fusion",
            s(imp),
            "--cross-entropy-loss-fusion",
        );
    }
    // Transformer Engine's own switches, where Megatron does not set them from
    // --attention-backend: NVTE_FUSED_ATTN=0 leaves the flash-attn kernels (FlashAttention-2,
    // what NGC containers ship), and with NVTE_FLASH_ATTN=0 as well the unfused attention.
    let env = |name: &str| r.vars.get(name).map(|v| v.trim() == "0");
    let te_backend = match (env("NVTE_FUSED_ATTN"), env("NVTE_FLASH_ATTN")) {
        (Some(true), Some(true)) => Some(("flash_attention", b(false))),
        (Some(true), _) => Some(("attention_backend", s("flash2"))),
        _ => None,
    };
    match (r.str("--attention-backend"), te_backend) {
        (None | Some("auto"), Some((key, value))) => {
            out.put(
                "training",
                key,
                value,
                "NVTE_FUSED_ATTN=0 (Transformer Engine skips cuDNN attention)",
            );
        }
        (Some("unfused") | Some("local"), _) => {
            out.put_arg(
                &r,
                "training",
                "flash_attention",
                b(false),
                "--attention-backend",
            );
        }
        (Some("flash"), _) => {
            out.put_arg(
                &r,
                "training",
                "attention_backend",
                s("flash2"),
                "--attention-backend",
            );
        }
        _ => {}
    }

    // Keys a translated config sets beyond Megatron's arguments.
    for (section, key, value, why) in std::mem::take(&mut r.extra_keys) {
        out.put(section, key, value, &why);
    }

    // Arguments that change a step's time but are not read.
    for (flag, why) in NOT_MODELLED {
        if r.unused.contains(*flag) {
            r.notes.push(format!("{flag}: {why}"));
        }
    }

    // The file.
    let name = opts.name.clone().unwrap_or_else(|| {
        std::path::Path::new(origin)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("megatron job")
            .to_string()
    });
    let (tool, what) = match r.dialect {
        Dialect::Script => ("megatron", "Megatron-LM argument"),
        Dialect::NemoConfig => ("nemo", "NeMo config key"),
    };
    let mut toml_text = format!(
        "# Written by `prism import {tool}` from {origin}.\n\
         # Each key names the {what} (and line) it was read from.\n\
         name = {}\n",
        toml::Value::String(name)
    );
    for section in ["model", "cluster", "parallel", "training"] {
        if let Some(lines) = out.sections.get(section) {
            toml_text.push_str(&format!("\n[{section}]\n"));
            for l in lines {
                toml_text.push_str(l);
                toml_text.push('\n');
            }
        }
    }
    if let Some(m) = &opts.measured {
        toml_text.push_str(&format!(
            "\n[published]\nsource = {}\niteration_time_s = {}\n",
            toml::Value::String(format!(
                "{}: median of {} logged iteration times (iterations {} to {}; the first {} \
                 record(s) skipped as warm-up)",
                m.origin, m.records, m.iterations.0, m.iterations.1, m.skipped
            )),
            toml::Value::Float(m.iteration_time_s)
        ));
    }
    if !r.notes.is_empty() {
        toml_text.push_str("\n# Notes:\n");
        for n in &r.notes {
            toml_text.push_str(&format!("# - {n}\n"));
        }
    }
    let unused: Vec<String> = r.unused.into_iter().collect();
    if !unused.is_empty() {
        toml_text.push_str(match r.dialect {
            Dialect::Script => "\n# Arguments of the script not used by Prism:\n",
            Dialect::NemoConfig => "\n# Keys of the config not used by Prism:\n",
        });
        for chunk in unused.chunks(6) {
            toml_text.push_str(&format!("#   {}\n", chunk.join(" ")));
        }
    }
    Ok(Imported {
        toml: toml_text,
        unused,
        notes: r.notes,
    })
}

/// Megatron's `--moe-layer-freq`: an integer step (MoE every `step`-th layer), or a Python list
/// expression of 0/1 per layer (`([0]*3+[1]*58)`, `[0]+[1]*26`, `([0,1]*24)`). Returns (dense
/// leading layers, step) when the pattern is one Prism models: `k` dense layers then MoE on
/// every layer, or MoE on every `step`-th layer.
fn moe_layer_freq(v: &str) -> Option<(u32, u32)> {
    if let Ok(step) = v.trim().parse::<u32>() {
        return (step >= 1).then_some((0, step));
    }
    let t: String = v.chars().filter(|c| !c.is_whitespace()).collect();
    let t = t
        .strip_prefix('(')
        .and_then(|x| x.strip_suffix(')'))
        .unwrap_or(&t);
    let mut layers: Vec<bool> = Vec::new();
    for term in t.split('+') {
        let (list, times) = match term.rsplit_once(")*").or_else(|| term.rsplit_once("]*")) {
            Some((l, n)) => (l, n.parse::<usize>().ok()?),
            None => (term, 1),
        };
        let list = list.trim_start_matches('(').trim_end_matches(')');
        let list = list.strip_prefix('[')?.trim_end_matches(']');
        let items: Vec<bool> = list
            .split(',')
            .map(|x| match x {
                "0" => Some(false),
                "1" => Some(true),
                _ => None,
            })
            .collect::<Option<_>>()?;
        if times.saturating_mul(items.len()) > 1 << 20 {
            return None;
        }
        for _ in 0..times {
            layers.extend(&items);
        }
    }
    let first_moe = layers.iter().position(|&m| m)?;
    if layers[first_moe..].iter().all(|&m| m) {
        return Some((u32::try_from(first_moe).ok()?, 1));
    }
    let step = first_moe + 1;
    let periodic = layers
        .iter()
        .enumerate()
        .all(|(l, &m)| m == ((l + 1) % step == 0));
    periodic.then(|| u32::try_from(step).ok().map(|s| (0, s)))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_and_expansion() {
        let mut v = BTreeMap::new();
        v.insert("GPUS_PER_NODE".to_string(), "8".to_string());
        v.insert("NUM_NODES".to_string(), "4".to_string());
        assert_eq!(expand("$(($GPUS_PER_NODE*$NUM_NODES))", &v), "32");
        assert_eq!(expand("$((GPUS_PER_NODE * (NUM_NODES + 1)))", &v), "40");
        assert_eq!(expand("${TP:-8}", &v), "8");
        assert_eq!(expand("${1:-\"ckpt/x\"}", &v), "ckpt/x");
        assert_eq!(expand("${NUM_NODES:-1}", &v), "4");
        assert_eq!(
            expand("--nnodes $NUM_NODES x${ARGS[@]}y", &v),
            "--nnodes 4 xy"
        );
        assert_eq!(expand("$UNSET and ${ALSO}", &v), "$UNSET and ${ALSO}");
        assert_eq!(arith("7 / 2 - -1"), Some(4));
        assert_eq!(arith("1 +"), None);
        assert_eq!(arith("9223372036854775807 + 1"), None);
    }

    #[test]
    fn words_split_array_elements_and_drop_comments() {
        assert_eq!(
            words("    \"--fp8-format hybrid\" --bf16 # --fp16"),
            ["--fp8-format", "hybrid", "--bf16"]
        );
        assert_eq!(
            words("MODEL_ARGS=( --num-layers 32 )"),
            ["MODEL_ARGS=", "--num-layers", "32"]
        );
        assert_eq!(words("--split '99,1,0'"), ["--split", "99,1,0"]);
        assert_eq!(
            words("A=(--seq-length 4096)"),
            ["A=", "--seq-length", "4096"]
        );
        assert_eq!(
            words("--pipeline-model-parallel-layout \"(Et|)*2,L\""),
            ["--pipeline-model-parallel-layout", "(Et|)*2,L"]
        );
    }

    #[test]
    fn conditions() {
        assert_eq!(condition("if [[ \"fp8\" == \"fp8\" ]]; then"), Some(true));
        assert_eq!(
            condition("if [[ \"x\" == \"MOCK\" ]] || [[ -z \"\" ]]; then"),
            Some(true)
        );
        assert_eq!(condition("elif [ 4 -gt 8 ]; then"), Some(false));
        assert_eq!(
            condition("if [ \"a\" != \"a\" ] && [ -n \"b\" ]"),
            Some(false)
        );
        assert_eq!(condition("if [ ! -f \"pretrain_gpt.py\" ]; then"), None);
        assert_eq!(condition("if [[ \"$UNSET\" == \"x\" ]]; then"), None);
        assert_eq!(condition("if [ 1 -eq 1 ]"), Some(true));
    }

    #[test]
    fn vocabulary_padding_is_megatrons() {
        // GPT-2's 50,257 tokens at TP 8: Megatron logs "new size: 51200".
        assert_eq!(padded_vocab(50257, 128, 8), 51200);
        assert_eq!(padded_vocab(50257, 128, 1), 50304);
        assert_eq!(padded_vocab(128256, 128, 1), 128256);
        assert_eq!(padded_vocab(128256, 128, 8), 129024);
    }

    #[test]
    fn moe_layer_freq_forms() {
        assert_eq!(moe_layer_freq("1"), Some((0, 1)));
        assert_eq!(moe_layer_freq("2"), Some((0, 2)));
        assert_eq!(moe_layer_freq("([0]*3+[1]*58)"), Some((3, 1)));
        assert_eq!(moe_layer_freq("[0]*1+[1]*26"), Some((1, 1)));
        assert_eq!(moe_layer_freq("[1]*61"), Some((0, 1)));
        assert_eq!(moe_layer_freq("([0]+[1]*26)"), Some((1, 1)));
        assert_eq!(moe_layer_freq("([0,1]*24)"), Some((0, 2)));
        assert_eq!(moe_layer_freq("[1,0]*24"), None);
        assert_eq!(moe_layer_freq("[2]*3"), None);
        assert_eq!(moe_layer_freq("([0]*3+[1]*5+[0]*2)"), None);
        assert_eq!(moe_layer_freq("0"), None);
    }
}
