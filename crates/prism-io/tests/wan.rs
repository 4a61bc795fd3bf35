//! The `[wan]` section: the example jobs load into the datacenters and links they describe,
//! and every broken rule is refused with its key (and line where the value came from the file).

use prism_io::jobfile::{JobFileError, load_job_file, load_job_str};

const BASE: &str = "[model]\npreset = \"llama3-8b\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 4\n\
                    [parallel]\ntp = 8\npp = 2\ndp = 2\n[training]\nglobal_batch = 8\n";

fn load(wan: &str) -> Result<prism_core::job::Job, JobFileError> {
    load_job_str(&format!("{BASE}[wan]\n{wan}"), "test", None, &[]).map(|l| l.job)
}

#[test]
fn examples_load_their_datacenters() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let j = load_job_file(&root.join("geo-llama3-405b-3dc.toml"), &[])
        .unwrap()
        .job;
    let w = &j.cluster.topology.wan;
    assert_eq!(w.datacenters.len(), 3);
    assert_eq!(w.datacenters[0].nodes, 1024);
    assert_eq!(w.links.len(), 3);
    assert_eq!(w.links[2].rtt_ms, 40.0);
    assert_eq!((w.links[2].a, w.links[2].b), (0, 2));
    assert_eq!(w.links[0].connections, 16);
    let j = load_job_file(&root.join("geo-llama3-70b-2dc.toml"), &[])
        .unwrap()
        .job;
    assert_eq!(j.cluster.topology.wan.links[0].gbps, 100.0);
}

#[test]
fn scalar_and_per_link_figures_and_defaults() {
    let j = load(
        "datacenters = [\"a\", \"b\", \"c\"]\ndatacenter_nodes = [2, 1, 1]\n\
         links = [\"a:b\", \"b:c\"]\nlink_gbps = [100, 50]\nlink_rtt_ms = 20\nsharing = \"temporal\"\n",
    )
    .unwrap();
    let w = &j.cluster.topology.wan;
    assert_eq!(w.links[1].gbps, 50.0);
    assert_eq!(w.links[1].rtt_ms, 20.0);
    assert_eq!(w.links[0].tcp_window_mib, 16.0);
    assert_eq!(w.links[0].connections, 1);
    assert_eq!(w.sharing, prism_core::wan::WanSharing::Temporal);
}

#[test]
fn broken_rules_name_their_key() {
    let cases = [
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 1]\nlinks = [\"a:b\"]\nlink_gbps = 1\nlink_rtt_ms = 1\n",
            "wan.datacenter_nodes",
            "add up",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a:c\"]\nlink_gbps = 1\nlink_rtt_ms = 1\n",
            "wan.links",
            "unknown datacenter",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a-b\"]\nlink_gbps = 1\nlink_rtt_ms = 1\n",
            "wan.links",
            "\"A:B\"",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a:b\"]\nlink_rtt_ms = 1\n",
            "wan.link_gbps",
            "missing",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a:b\"]\nlink_gbps = [1, 2]\nlink_rtt_ms = 1\n",
            "wan.link_gbps",
            "2 entries for 1 links",
        ),
        (
            "datacenters = [\"a\", \"b\", \"c\"]\ndatacenter_nodes = [2, 1, 1]\nlinks = [\"a:b\"]\nlink_gbps = 1\nlink_rtt_ms = 1\n",
            "wan.links",
            "not connected",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a:b\"]\nlink_gbps = 1\nlink_rtt_ms = 1\nconnections = 0\n",
            "wan.connections",
            "[1, 65536]",
        ),
        (
            "datacenters = [\"a\", \"b\"]\ndatacenter_nodes = [2, 2]\nlinks = [\"a:b\"]\nlink_gbps = 1\nlink_rtt_ms = 1\nsharing = \"fifo\"\n",
            "wan.sharing",
            "must be one of",
        ),
        ("datacenters = \"a\"\n", "wan.datacenters", "an array"),
        (
            "datacenters = [\"a\", \"a\"]\ndatacenter_nodes = [2, 2]\n",
            "wan.datacenters",
            "named twice",
        ),
    ];
    for (wan, key, rule) in cases {
        let e = load(wan).expect_err(wan);
        assert_eq!(e.key.as_deref(), Some(key), "{wan}: {e}");
        assert!(e.rule.contains(rule), "{wan}: {e}");
    }
}

/// Arrival traces (Vidur's processed Splitwise columns): read, sorted, and refused by line.
#[test]
fn arrival_traces() {
    let dir = std::env::temp_dir().join(format!("prism-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.csv");
    std::fs::write(
        &good,
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,1024,10\n0.1,300,5\n",
    )
    .unwrap();
    let r = prism_io::geo::read_arrival_trace(&good).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].arrival_s, r[0].prompt_tokens), (0.1, 300));
    assert_eq!(r[1].prompt_tokens, 1024);
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "arrived_at,num_prefill_tokens\n0.5,1024\nx,3\n").unwrap();
    let e = prism_io::geo::read_arrival_trace(&bad).unwrap_err();
    assert!(e.contains(":3:") && e.contains("arrived_at"), "{e}");
    let missing = dir.join("missing.csv");
    std::fs::write(&missing, "time,tokens\n1,2\n").unwrap();
    let e = prism_io::geo::read_arrival_trace(&missing).unwrap_err();
    assert!(e.contains("arrived_at"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
