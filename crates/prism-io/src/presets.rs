//! Built-in presets: models, clusters and example jobs.
//!
//! Every preset is a TOML file under `crates/prism-io/presets/`, embedded in the binary with
//! `include_str!`. A model preset holds the keys of a job's `[model]` section, a cluster preset the
//! keys of `[cluster]` (never `nodes`: the job gives the node count), a job preset a whole job
//! file. Each file cites its sources in comments. See `docs/job-format.md`.

/// Model presets: (name, TOML text with `[model]` keys).
const MODELS: &[(&str, &str)] = &[
    ("gpt-1.7b", include_str!("../presets/models/gpt-1.7b.toml")),
    ("gpt-3.6b", include_str!("../presets/models/gpt-3.6b.toml")),
    ("gpt-7.5b", include_str!("../presets/models/gpt-7.5b.toml")),
    ("gpt-18b", include_str!("../presets/models/gpt-18b.toml")),
    ("gpt-39b", include_str!("../presets/models/gpt-39b.toml")),
    ("gpt-76b", include_str!("../presets/models/gpt-76b.toml")),
    ("gpt-145b", include_str!("../presets/models/gpt-145b.toml")),
    ("gpt-310b", include_str!("../presets/models/gpt-310b.toml")),
    ("gpt-530b", include_str!("../presets/models/gpt-530b.toml")),
    ("gpt-1t", include_str!("../presets/models/gpt-1t.toml")),
    (
        "gpt3-175b",
        include_str!("../presets/models/gpt3-175b.toml"),
    ),
    (
        "llama3-8b",
        include_str!("../presets/models/llama3-8b.toml"),
    ),
    (
        "llama3-70b",
        include_str!("../presets/models/llama3-70b.toml"),
    ),
    (
        "llama3-405b",
        include_str!("../presets/models/llama3-405b.toml"),
    ),
    (
        "llama3.1-8b",
        include_str!("../presets/models/llama3.1-8b.toml"),
    ),
    (
        "llama3.1-70b",
        include_str!("../presets/models/llama3.1-70b.toml"),
    ),
    (
        "llama3.1-405b",
        include_str!("../presets/models/llama3.1-405b.toml"),
    ),
    (
        "mixtral-8x7b",
        include_str!("../presets/models/mixtral-8x7b.toml"),
    ),
    (
        "nemotron4-15b",
        include_str!("../presets/models/nemotron4-15b.toml"),
    ),
    (
        "nemotron4-340b",
        include_str!("../presets/models/nemotron4-340b.toml"),
    ),
    (
        "deepseek-v2",
        include_str!("../presets/models/deepseek-v2.toml"),
    ),
    (
        "deepseek-v3",
        include_str!("../presets/models/deepseek-v3.toml"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../presets/models/qwen3-235b-a22b.toml"),
    ),
    (
        "gemma3-27b",
        include_str!("../presets/models/gemma3-27b.toml"),
    ),
    (
        "llama4-maverick",
        include_str!("../presets/models/llama4-maverick.toml"),
    ),
    (
        "qwen3-30b-a3b",
        include_str!("../presets/models/qwen3-30b-a3b.toml"),
    ),
    (
        "gpt-oss-120b",
        include_str!("../presets/models/gpt-oss-120b.toml"),
    ),
    (
        "gpt-oss-20b",
        include_str!("../presets/models/gpt-oss-20b.toml"),
    ),
    ("kimi-k2", include_str!("../presets/models/kimi-k2.toml")),
    (
        "glm-4.5-air",
        include_str!("../presets/models/glm-4.5-air.toml"),
    ),
];

/// Cluster presets: (name, TOML text with `[cluster]` keys, without `nodes`).
const CLUSTERS: &[(&str, &str)] = &[
    (
        "dgx-a100-80g",
        include_str!("../presets/clusters/dgx-a100-80g.toml"),
    ),
    (
        "dgx-h100",
        include_str!("../presets/clusters/dgx-h100.toml"),
    ),
    (
        "dgx-h200",
        include_str!("../presets/clusters/dgx-h200.toml"),
    ),
    (
        "dgx-b200",
        include_str!("../presets/clusters/dgx-b200.toml"),
    ),
    (
        "dgx-h800",
        include_str!("../presets/clusters/dgx-h800.toml"),
    ),
    (
        "gb200-nvl72",
        include_str!("../presets/clusters/gb200-nvl72.toml"),
    ),
];

/// Job presets: (name, whole job file).
const JOBS: &[(&str, &str)] = &[(
    "llama3-405b-16k-h100",
    include_str!("../presets/jobs/llama3-405b-16k-h100.toml"),
)];

fn lookup(table: &'static [(&'static str, &'static str)], name: &str) -> Option<&'static str> {
    table
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}

/// The TOML text of the model preset `name` (keys of a `[model]` section).
pub fn model_preset(name: &str) -> Option<&'static str> {
    lookup(MODELS, name)
}

/// The TOML text of the cluster preset `name` (keys of a `[cluster]` section, no `nodes`).
pub fn cluster_preset(name: &str) -> Option<&'static str> {
    lookup(CLUSTERS, name)
}

/// The TOML text of the job preset `name` (a whole job file).
pub fn job_preset(name: &str) -> Option<&'static str> {
    lookup(JOBS, name)
}

/// Names of all model presets.
pub fn model_preset_names() -> Vec<&'static str> {
    MODELS.iter().map(|(n, _)| *n).collect()
}

/// Names of all cluster presets.
pub fn cluster_preset_names() -> Vec<&'static str> {
    CLUSTERS.iter().map(|(n, _)| *n).collect()
}

/// Names of all job presets.
pub fn job_preset_names() -> Vec<&'static str> {
    JOBS.iter().map(|(n, _)| *n).collect()
}

/// Edit (Levenshtein) distance between two strings, by characters.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The candidate closest to `name` when it is close enough to be a plausible typo
/// (edit distance at most max(2, len/3)), or one that `name` is a prefix of / that is a prefix of
/// `name` (e.g. `llama3-405` -> `llama3-405b`).
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lname = name.to_ascii_lowercase();
    let limit = 2.max(name.chars().count() / 3);
    let mut best: Option<(usize, &'a str)> = None;
    for c in candidates {
        let lc = c.to_ascii_lowercase();
        let mut d = edit_distance(&lname, &lc);
        if d > limit && !lname.is_empty() && (lc.starts_with(&lname) || lname.starts_with(&lc)) {
            d = limit;
        }
        if d <= limit && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance() {
        assert_eq!(edit_distance("tpp", "tp"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(closest("tpp", ["tp", "pp", "cp"]), Some("tp"));
        assert_eq!(
            closest("llama3-405", model_preset_names()),
            Some("llama3-405b")
        );
        assert_eq!(closest("zzzzzzzzzz", ["tp"]), None);
    }

    #[test]
    fn names_are_unique_and_found() {
        for names in [
            model_preset_names(),
            cluster_preset_names(),
            job_preset_names(),
        ] {
            let mut sorted = names.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), names.len());
        }
        for n in model_preset_names() {
            assert!(model_preset(n).is_some());
        }
        assert!(cluster_preset("dgx-h100").is_some());
        assert!(model_preset("nope").is_none());
    }
}
