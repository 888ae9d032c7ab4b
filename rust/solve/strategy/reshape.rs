//! Strategies of views that merge and split dims (view, reshape, flatten,
//! unflatten). Dims are grouped where the products of consecutive sizes
//! match; in each group only the major (first non-unit) dim can carry a
//! shard, on both sides, with the same axes, when both sizes divide.

use crate::error::{invalid_argument, Result};
use crate::sharding::enumerate::enumerate_specs;
use crate::sharding::spec::ShardingSpec;

/// Consecutive dims of the input and output that hold the same elements.
fn groups(input: &[usize], output: &[usize]) -> Option<Vec<(Vec<usize>, Vec<usize>)>> {
    let mut out = Vec::new();
    let (mut i, mut o) = (0, 0);
    while i < input.len() || o < output.len() {
        let (mut gi, mut go) = (Vec::new(), Vec::new());
        let (mut pi, mut po) = (1usize, 1usize);
        loop {
            if pi <= po && i < input.len() && (gi.is_empty() || pi < po || go.is_empty()) {
                pi = pi.checked_mul(input[i])?;
                gi.push(i);
                i += 1;
            } else if o < output.len() {
                po = po.checked_mul(output[o])?;
                go.push(o);
                o += 1;
            } else if i < input.len() {
                pi = pi.checked_mul(input[i])?;
                gi.push(i);
                i += 1;
            } else {
                break;
            }
            if pi == po && !gi.is_empty() && !go.is_empty() {
                // Absorb trailing unit dims into this group.
                while i < input.len() && input[i] == 1 && (o >= output.len() || output[o] != 1) {
                    gi.push(i);
                    i += 1;
                }
                while o < output.len() && output[o] == 1 && (i >= input.len() || input[i] != 1) {
                    go.push(o);
                    o += 1;
                }
                break;
            }
        }
        if pi != po {
            return None;
        }
        out.push((gi, go));
    }
    Some(out)
}

/// (input spec, output spec) pairs of a view from `input` to `output` shape.
pub fn reshape_strategies(
    input: &[usize],
    output: &[usize],
    mesh_shape: &[usize],
) -> Result<Vec<(ShardingSpec, ShardingSpec)>> {
    let Some(groups) = groups(input, output) else {
        return invalid_argument(format!(
            "cannot view a tensor of shape {input:?} as {output:?}: the element counts differ \
             (or overflow)"
        ));
    };
    let mut pairs = Vec::new();
    'spec: for spec in enumerate_specs(input, mesh_shape)? {
        let mut out_dims: Vec<Vec<usize>> = vec![Vec::new(); output.len()];
        for (gi, go) in &groups {
            let major_in = gi.iter().copied().find(|&d| input[d] != 1);
            let major_out = go.iter().copied().find(|&d| output[d] != 1);
            for &d in gi {
                let axes: Vec<usize> = spec
                    .dim_axes(d)
                    .as_slice()
                    .iter()
                    .map(|&a| a as usize)
                    .collect();
                if axes.is_empty() {
                    continue;
                }
                let parts: usize = axes.iter().map(|&a| mesh_shape[a]).product();
                match (Some(d) == major_in, major_out) {
                    (true, Some(od)) if output[od].is_multiple_of(parts) => out_dims[od] = axes,
                    _ => continue 'spec,
                }
            }
        }
        let out_spec = ShardingSpec::from_dims(&out_dims)?;
        pairs.push((spec, out_spec));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(input: &[usize], output: &[usize], mesh: &[usize]) -> Vec<(String, String)> {
        reshape_strategies(input, output, mesh)
            .unwrap()
            .into_iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn merge_keeps_major_shards_only() {
        let s = specs(&[4, 6, 8], &[24, 8], &[2]);
        assert!(s.contains(&("S0RR".into(), "S0R".into())));
        assert!(s.contains(&("RRS0".into(), "RS0".into())));
        assert!(!s.iter().any(|(a, _)| a == "RS0R"));
    }

    #[test]
    fn split_heads_keeps_hidden_shard() {
        // [b, s, h] -> [b, s, heads, head_dim]
        let s = specs(&[2, 4, 12], &[2, 4, 3, 4], &[3]);
        assert!(s.contains(&("RRS0".into(), "RRS0R".into())));
        let s = specs(&[2, 4, 12], &[2, 4, 3, 4], &[2]);
        assert!(!s.iter().any(|(a, _)| a == "RRS0")); // 3 heads do not split in 2
    }

    #[test]
    fn unit_dims_and_bad_views() {
        let s = specs(&[8, 1, 4], &[8, 4], &[2]);
        assert!(s.contains(&("S0RR".into(), "S0R".into())));
        assert!(s.contains(&("RRS0".into(), "RS0".into())));
        let s = specs(&[8], &[1, 8, 1], &[2]);
        assert!(s.contains(&("S0".into(), "RS0R".into())));
        assert!(reshape_strategies(&[4, 4], &[5, 3], &[2]).is_err());
    }
}
