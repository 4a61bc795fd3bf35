//! `prism geo sweep`.
#[derive(Debug, clap::Args)]
pub struct SweepArgs {}
pub fn run(_a: &SweepArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
