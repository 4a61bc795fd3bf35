//! Megatron-Core's custom pipeline layout (`--pipeline-model-parallel-layout`).
//!
//! The string lists the virtual pipeline stages in order, separated by `|`; each stage lists
//! its layers: `E` the embedding, `t` a transformer decoder layer, `m` a multi-token-prediction
//! layer, `L` the output layer and loss. `x*n` repeats one character, `(...)*n` repeats a group
//! (which may hold `|`), commas are cosmetic and empty stages are legal. With `pp` pipeline
//! ranks and `S` stages, `S` must be a multiple of `pp`; virtual stage `s` runs on pipeline rank
//! `s % pp` as its model chunk `s / pp`, so `vpp = S / pp`.
//!
//! Megatron-Core's documentation gives DeepSeek-V3 on pp 16, vpp 2 as `Et*3|(tt|)*29,m|L`;
//! the Llama 3 paper's balancing (one layer fewer on the first and the last stage, Dubey et
//! al. 2024, Sec. 3.3.2) is `E|(t|)*126,L` for 126 layers on pp 16, vpp 8.
//!
//! The `m` layers follow Megatron-Core's rules: all in one virtual stage, after every decoder
//! layer; the job check adds that this stage is the last model chunk of its pipeline rank and
//! that there are as many as `model.mtp_depth`. On a stage before the loss ("standalone"), the
//! MTP modules run there and their hidden states travel with the main one to the loss stage,
//! which computes every head.
//!
//! Prism's reader is a small recursive-descent parser: groups may nest (Megatron's own
//! regular-expression expansion does not), whitespace is ignored, and every error says which
//! character or stage broke which rule.
//!
//! ```
//! use prism_core::pipeline_layout::PipelineLayout;
//! let l = PipelineLayout::parse("Et*3|(tt|)*2,t|L").unwrap();
//! assert_eq!(l.stages, vec![3, 2, 2, 1, 0]);
//! assert!(PipelineLayout::parse("Et|tx|L").unwrap_err().contains("'x'"));
//! ```

/// The longest expanded layout Prism accepts, in characters (a layout names each layer once,
/// so real ones stay far below it).
pub const MAX_EXPANDED: usize = 1 << 20;

/// A parsed pipeline layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineLayout {
    /// The string as written.
    pub text: String,
    /// Decoder layers on each virtual stage, in the string's order.
    pub stages: Vec<u32>,
    /// The virtual stage holding the multi-token-prediction layers (`m`), if the layout
    /// places any (Megatron-Core puts them all on one stage, after every decoder layer).
    pub mtp_stage: Option<usize>,
    /// Multi-token-prediction layers (`m`) in the layout.
    pub mtp_layers: u32,
}

impl PipelineLayout {
    /// Parses a layout string; the error names the offending character or stage and the rule.
    pub fn parse(text: &str) -> Result<Self, String> {
        let chars: Vec<char> = text
            .chars()
            .filter(|c| *c != ',' && !c.is_whitespace())
            .collect();
        let mut p = Parser {
            chars: &chars,
            pos: 0,
        };
        let expanded = p.sequence(0)?;
        if p.pos < chars.len() {
            return Err(format!(
                "unmatched ')' at character {} of the layout",
                p.pos + 1
            ));
        }
        let stage_texts: Vec<&[char]> = expanded.split(|c| *c == '|').collect();
        let last = stage_texts.len() - 1;
        let mut stages = Vec::with_capacity(stage_texts.len());
        let (mut embeddings, mut losses) = (0u32, 0u32);
        let (mut mtp_stage, mut mtp_layers) = (None::<usize>, 0u32);
        for (i, stage) in stage_texts.iter().enumerate() {
            let mut layers = 0u32;
            for (j, &c) in stage.iter().enumerate() {
                match c {
                    't' => {
                        if let Some(ms) = mtp_stage {
                            return Err(format!(
                                "decoder layer 't' in stage {i} comes after the \
                                 multi-token-prediction layer 'm' of stage {ms}; Megatron-Core \
                                 places every decoder layer before the MTP layers"
                            ));
                        }
                        layers += 1;
                    }
                    'E' => {
                        embeddings += 1;
                        if i != 0 || j != 0 {
                            return Err(format!(
                                "the embedding 'E' must open the first stage (found in stage {i}, \
                                 position {j}); Prism feeds the pipeline's input at virtual stage 0"
                            ));
                        }
                    }
                    'L' => {
                        losses += 1;
                        if i != last || j + 1 != stage.len() {
                            return Err(format!(
                                "the loss 'L' must close the last stage (found in stage {i} of \
                                 {}, position {j})",
                                last + 1
                            ));
                        }
                    }
                    'm' => {
                        match mtp_stage {
                            Some(ms) if ms != i => {
                                return Err(format!(
                                    "multi-token-prediction layers 'm' in stages {ms} and {i}; \
                                     Megatron-Core keeps all of them in one virtual stage"
                                ));
                            }
                            _ => mtp_stage = Some(i),
                        }
                        mtp_layers += 1;
                    }
                    other => {
                        return Err(format!(
                            "unknown layer character '{other}' in stage {i}; known: E \
                             (embedding), t (transformer decoder layer), m (MTP layer), L (loss)"
                        ));
                    }
                }
            }
            stages.push(layers);
        }
        if embeddings == 0 {
            return Err("the layout has no embedding 'E' (it must open the first stage)".into());
        }
        if losses == 0 {
            return Err("the layout has no loss 'L' (it must close the last stage)".into());
        }
        Ok(PipelineLayout {
            text: text.to_string(),
            stages,
            mtp_stage,
            mtp_layers,
        })
    }

    /// Decoder layers in the whole layout.
    pub fn decoder_layers(&self) -> u64 {
        self.stages.iter().map(|&l| l as u64).sum()
    }

    /// The layout with `layers[s]` decoder layers on virtual stage `s`, the embedding opening
    /// the first stage and the loss closing the last, written as Megatron-Core would: a run of
    /// equal middle stages becomes `(t*k|)*n,`. Panics on an empty slice (no stage).
    pub fn from_stage_layers(layers: &[u32]) -> Self {
        assert!(!layers.is_empty(), "a pipeline layout needs a stage");
        let stage = |k: u32| match k {
            0 => String::new(),
            1 => "t".to_string(),
            2 => "tt".to_string(),
            k => format!("t*{k}"),
        };
        let last = layers.len() - 1;
        let mut text = format!("E{}", stage(layers[0]));
        if last > 0 {
            text.push('|');
            let mut i = 1;
            while i < last {
                let run = layers[i..last]
                    .iter()
                    .take_while(|&&k| k == layers[i])
                    .count();
                if run == 1 {
                    text.push_str(&format!("{}|", stage(layers[i])));
                } else {
                    text.push_str(&format!("({}|)*{run},", stage(layers[i])));
                }
                i += run;
            }
            text.push_str(&stage(layers[last]));
        }
        text.push('L');
        let parsed = Self::parse(&text).expect("a generated layout parses");
        debug_assert_eq!(parsed.stages, layers);
        parsed
    }
}

/// torchtitan's split of `layers` decoder layers over `stages` virtual pipeline stages
/// (`torchtitan/distributed/pipeline_parallel.py`, `_generate_llm_fqn_per_model_part`, the
/// same since July 2025): the embedding counts as `input_weight` layers and the norm and
/// output head as `output_weight` (`pipeline_parallel_first_stage_less_layers` and
/// `..._last_stage_less_layers`, 1 by default); the `layers + input_weight + output_weight`
/// effective layers are dealt out evenly, the remainder one each to the first stages, and the
/// first (last) stage builds `input_weight` (`output_weight`) fewer decoder layers. Returns the
/// decoder layers of each stage, or torchtitan's refusal as a rule.
pub fn torchtitan_stage_layers(
    stages: u32,
    layers: u32,
    input_weight: u32,
    output_weight: u32,
) -> Result<Vec<u32>, String> {
    if stages == 0 {
        return Err("needs at least one pipeline stage".into());
    }
    if stages == 1 {
        return Ok(vec![layers]);
    }
    let effective = u64::from(layers) + u64::from(input_weight) + u64::from(output_weight);
    let n = u64::from(stages);
    if n > effective {
        return Err(format!(
            "{stages} stages cannot be more than the effective layers {effective} (layers \
             {layers} + first-stage weight {input_weight} + last-stage weight {output_weight})"
        ));
    }
    let per = effective / n;
    let extra = effective % n;
    for (what, w) in [("first", input_weight), ("last", output_weight)] {
        if u64::from(w) > per {
            return Err(format!(
                "the {what}-stage weight {w} exceeds the fewest effective layers per stage \
                 ({effective} over {stages} stages: {per}); torchtitan refuses this split"
            ));
        }
    }
    let mut left = u64::from(layers);
    let mut out = Vec::with_capacity(stages as usize);
    for s in 0..n {
        let mut k = per + u64::from(s < extra);
        if s == 0 {
            k -= u64::from(input_weight);
        } else if s == n - 1 {
            k -= u64::from(output_weight);
        }
        let k = k.min(left);
        left -= k;
        out.push(k as u32);
    }
    debug_assert_eq!(left, 0, "the effective layers add up to the model's");
    Ok(out)
}

struct Parser<'a> {
    chars: &'a [char],
    pos: usize,
}

impl Parser<'_> {
    /// A sequence of items up to the end or a closing parenthesis.
    fn sequence(&mut self, depth: usize) -> Result<Vec<char>, String> {
        let mut out = Vec::new();
        while let Some(&c) = self.chars.get(self.pos) {
            let item = match c {
                ')' => {
                    if depth == 0 {
                        return Err(format!(
                            "unmatched ')' at character {} of the layout",
                            self.pos + 1
                        ));
                    }
                    return Ok(out);
                }
                '(' => {
                    let open = self.pos;
                    self.pos += 1;
                    let inner = self.sequence(depth + 1)?;
                    if self.chars.get(self.pos) != Some(&')') {
                        return Err(format!(
                            "'(' at character {} of the layout is never closed",
                            open + 1
                        ));
                    }
                    self.pos += 1;
                    if inner.is_empty() {
                        return Err(format!(
                            "empty group '()' at character {} of the layout",
                            open + 1
                        ));
                    }
                    inner
                }
                '*' => {
                    return Err(format!(
                        "'*' at character {} of the layout repeats nothing (write x*n or (...)*n)",
                        self.pos + 1
                    ));
                }
                c => {
                    self.pos += 1;
                    vec![c]
                }
            };
            let times = self.repeat()?;
            let add = item.len().saturating_mul(times);
            if out.len().saturating_add(add) > MAX_EXPANDED {
                return Err(format!(
                    "the layout expands to more than {MAX_EXPANDED} characters"
                ));
            }
            for _ in 0..times {
                out.extend_from_slice(&item);
            }
        }
        Ok(out)
    }

    /// An optional `*n` after an item: its repeat count (1 when absent).
    fn repeat(&mut self) -> Result<usize, String> {
        if self.chars.get(self.pos) != Some(&'*') {
            return Ok(1);
        }
        let star = self.pos;
        self.pos += 1;
        let start = self.pos;
        while self.chars.get(self.pos).is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(format!(
                "'*' at character {} of the layout must be followed by a repeat count",
                star + 1
            ));
        }
        let digits: String = self.chars[start..self.pos].iter().collect();
        digits
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= MAX_EXPANDED)
            .ok_or_else(|| {
                format!(
                    "repeat count {digits} at character {} of the layout is larger than {MAX_EXPANDED}",
                    star + 2
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_documented_examples() {
        // DeepSeek-V3's example (61 decoder layers and one MTP layer, pp 16, vpp 2): 32
        // virtual stages; Megatron's rank map puts embedding + 3 layers on stage 0, 2 layers
        // on stages 1-29, the MTP layer alone on stage 30 (rank 14, chunk 1) and the loss
        // alone on stage 31 (rank 15, chunk 1).
        let l = PipelineLayout::parse("Et*3|(tt|)*29,m|L").unwrap();
        assert_eq!(l.stages.len(), 32);
        assert_eq!(l.stages[0], 3);
        assert!(l.stages[1..30].iter().all(|&s| s == 2));
        assert_eq!((l.stages[30], l.stages[31]), (0, 0));
        assert_eq!(l.decoder_layers(), 61);
        assert_eq!((l.mtp_stage, l.mtp_layers), (Some(30), 1));
        // Megatron's argument help example: two MTP layers in one stage, an empty stage.
        let l = PipelineLayout::parse("E|(t|)*3,m|m||L").unwrap_err();
        assert!(l.contains("stages 4 and 5"), "{l}");
        let l = PipelineLayout::parse("E|(t|)*3,mm||L").unwrap();
        assert_eq!((l.mtp_stage, l.mtp_layers), (Some(4), 2));
        assert_eq!(PipelineLayout::parse("Et|tL").unwrap().mtp_stage, None);
        // Empty stages are legal.
        assert_eq!(
            PipelineLayout::parse("E||t|L").unwrap().stages,
            vec![0, 0, 1, 0]
        );
        // Megatron's own comment examples of the expansion rules.
        assert_eq!(
            PipelineLayout::parse("E(tt|t)*2,t|L").unwrap().stages,
            vec![2, 3, 2, 0]
        );
        assert_eq!(
            PipelineLayout::parse("E|(t|)*126,L").unwrap().stages.len(),
            128
        );
    }

    #[test]
    fn nesting_whitespace_and_multi_digit_counts() {
        let l = PipelineLayout::parse(" E t , | ((t|)*2 t*2|)*10 L ").unwrap();
        assert_eq!(l.stages.len(), 1 + 30 + 1);
        assert_eq!(l.decoder_layers(), 1 + 10 * 4);
    }

    #[test]
    fn errors_name_the_character_and_rule() {
        let cases = [
            ("Et|tx|L", "unknown layer character 'x' in stage 1"),
            ("tE|t|L", "'E' must open the first stage"),
            ("Et|L|t", "'L' must close the last stage"),
            ("Et|tL|t", "'L' must close the last stage"),
            ("t|t|L", "no embedding"),
            ("Et|t|t", "no loss"),
            ("Et|(tt|t", "never closed"),
            ("Et|tt)|L", "unmatched ')'"),
            ("*3Et|L", "repeats nothing"),
            ("Et|(*3)|L", "repeats nothing"),
            ("Et|t*|L", "followed by a repeat count"),
            ("Et|()*2|L", "empty group"),
            (
                "Etm|t|L",
                "comes after the multi-token-prediction layer 'm' of stage 0",
            ),
            ("Et|tm|mL", "in stages 1 and 2"),
            ("E(t*1000)*100000|L", "expands to more than"),
            ("Et*99999999999999999999|L", "larger than"),
            ("EE|t|L", "'E' must open the first stage"),
        ];
        for (text, want) in cases {
            let err = PipelineLayout::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn generated_layouts_read_back_and_read_as_megatron_writes_them() {
        let cases: [(&[u32], &str); 6] = [
            (&[126], "Et*126L"),
            (&[1, 1], "Et|tL"),
            (&[0, 2, 2, 2, 0], "E|(tt|)*3,L"),
            (&[3, 2, 2, 2, 1], "Et*3|(tt|)*3,tL"),
            (&[2, 3, 2, 2, 1], "Ett|t*3|(tt|)*2,tL"),
            (&[4, 5, 4, 4, 4, 4, 4, 3], "Et*4|t*5|(t*4|)*5,t*3L"),
        ];
        for (layers, text) in cases {
            let l = PipelineLayout::from_stage_layers(layers);
            assert_eq!(l.text, text);
            assert_eq!(l.stages, layers);
            assert_eq!(PipelineLayout::parse(text).unwrap(), l);
        }
        // Every split of up to 7 stages with up to 3 layers each reads back.
        for code in 0..4u32.pow(7) {
            let n = 1 + code as usize % 7;
            let layers: Vec<u32> = (0..n).map(|i| (code / 4u32.pow(i as u32)) % 4).collect();
            let l = PipelineLayout::from_stage_layers(&layers);
            assert_eq!(
                PipelineLayout::parse(&l.text).unwrap().stages,
                layers,
                "{}",
                l.text
            );
        }
    }

    #[test]
    fn torchtitan_split_as_its_code_deals_the_layers() {
        // The example of _generate_llm_fqn_per_model_part's docstring: 3 layers over 2
        // stages with both weights 2: 7 effective layers, 4 then 3.
        assert_eq!(torchtitan_stage_layers(2, 3, 2, 2).unwrap(), vec![2, 1]);
        // Llama 3 8B (32 layers) on pp 4 with 2 stages per rank, torchtitan's defaults:
        // 34 effective layers over 8 stages, 4 each and one more for the first two.
        assert_eq!(
            torchtitan_stage_layers(8, 32, 1, 1).unwrap(),
            vec![4, 5, 4, 4, 4, 4, 4, 3]
        );
        // One stage holds everything; the weights play no part.
        assert_eq!(torchtitan_stage_layers(1, 32, 5, 5).unwrap(), vec![32]);
        // Closed form over a grid: the counts add up to the model's layers, and with the
        // weights added back to the end stages every stage carries floor(e / s) or one more
        // effective layers, the larger ones first.
        for stages in 2..=12u32 {
            for layers in 1..=40u32 {
                for (iw, ow) in [(0, 0), (1, 1), (2, 1), (0, 3)] {
                    let Ok(split) = torchtitan_stage_layers(stages, layers, iw, ow) else {
                        continue;
                    };
                    assert_eq!(split.iter().sum::<u32>(), layers);
                    let e = layers + iw + ow;
                    let mut eff = split.clone();
                    eff[0] += iw;
                    eff[stages as usize - 1] += ow;
                    let want: Vec<u32> = (0..stages)
                        .map(|s| e / stages + u32::from(s < e % stages))
                        .collect();
                    assert_eq!(eff, want, "{stages} stages, {layers} layers, {iw}/{ow}");
                }
            }
        }
        let err = torchtitan_stage_layers(36, 32, 1, 1).unwrap_err();
        assert!(
            err.contains("36 stages cannot be more than the effective layers 34"),
            "{err}"
        );
        let err = torchtitan_stage_layers(16, 30, 3, 1).unwrap_err();
        assert!(err.contains("first-stage weight 3 exceeds"), "{err}");
        assert!(torchtitan_stage_layers(0, 30, 1, 1).is_err());
    }
}
