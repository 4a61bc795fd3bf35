//! `prism geo bubbles`.
#[derive(Debug, clap::Args)]
pub struct BubblesArgs {}
pub fn run(_a: &BubblesArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
