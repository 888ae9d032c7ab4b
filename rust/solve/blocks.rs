//! Repeated-block detection (TAP's shared subgraphs): models are stacks of
//! identical blocks, so a planner can decide one block and reuse the
//! decision. Nodes are grouped into block instances by the first indexed
//! component of their module path (`transformer.h.3.attn` -> container
//! `transformer.h`, instance 3); instances of a container whose structure
//! hashes equal (ops, shapes and wiring, with inputs from outside the
//! instance keyed by shape only) form one class. A container whose instances
//! differ yields several classes (e.g. dense and MoE layers).

use rustc_hash::FxHashMap;
use std::collections::hash_map::DefaultHasher;

use crate::error::{check_earlier, Result};
use std::hash::{Hash, Hasher};

/// What block detection needs to know about one graph node.
#[derive(Debug, Clone)]
pub struct BlockNode {
    /// The op and output shapes/dtypes, e.g. `aten.linear.default|f32[8,16]`.
    pub key: String,
    /// Output shapes/dtypes only, used when the node feeds another instance.
    pub shape_key: String,
    pub module_path: String,
    /// Indices of the nodes it reads (earlier in the list).
    pub inputs: Vec<usize>,
}

/// Instances of one repeated block: `instances[k][j]` is node `j` of
/// instance `k`, corresponding nodes at equal `j`; instances in graph order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockClass {
    pub container: String,
    pub instances: Vec<Vec<usize>>,
}

/// The container and instance index of a module path, from its first
/// component that is an integer.
fn instance_of(path: &str) -> Option<(String, u64)> {
    let parts: Vec<&str> = path.split('.').collect();
    let i = parts
        .iter()
        .position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))?;
    if i == 0 {
        return None;
    }
    Some((parts[..i].join("."), parts[i].parse().ok()?))
}

/// Classes of structurally identical block instances with at least two
/// instances. Every node must read only earlier nodes.
pub fn detect_blocks(nodes: &[BlockNode]) -> Result<Vec<BlockClass>> {
    check_earlier(
        "detect_blocks: the inputs",
        nodes.iter().map(|n| n.inputs.as_slice()),
    )?;
    // (container, index) -> node indices in graph order.
    let mut order: Vec<(String, u64)> = Vec::new();
    let mut members: FxHashMap<(String, u64), Vec<usize>> = FxHashMap::default();
    for (i, node) in nodes.iter().enumerate() {
        let Some(inst) = instance_of(&node.module_path) else {
            continue;
        };
        members
            .entry(inst.clone())
            .or_insert_with(|| {
                order.push(inst);
                Vec::new()
            })
            .push(i);
    }
    let mut classes: Vec<BlockClass> = Vec::new();
    // container -> signature -> class index
    let mut by_signature: FxHashMap<(String, u64), usize> = FxHashMap::default();
    for inst in &order {
        let list = &members[inst];
        let signature = instance_signature(nodes, list);
        let key = (inst.0.clone(), signature);
        match by_signature.get(&key) {
            Some(&c) => classes[c].instances.push(list.clone()),
            None => {
                by_signature.insert(key, classes.len());
                classes.push(BlockClass {
                    container: inst.0.clone(),
                    instances: vec![list.clone()],
                });
            }
        }
    }
    classes.retain(|c| c.instances.len() > 1);
    Ok(classes)
}

fn instance_signature(nodes: &[BlockNode], list: &[usize]) -> u64 {
    let position: FxHashMap<usize, usize> = list.iter().enumerate().map(|(j, &i)| (i, j)).collect();
    let mut h = DefaultHasher::new();
    list.len().hash(&mut h);
    for &i in list {
        nodes[i].key.hash(&mut h);
        for input in &nodes[i].inputs {
            match position.get(input) {
                Some(j) => (0u8, *j).hash(&mut h),
                None => (1u8, &nodes[*input].shape_key).hash(&mut h),
            }
        }
        0xFFu8.hash(&mut h);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(key: &str, path: &str, inputs: &[usize]) -> BlockNode {
        BlockNode {
            key: key.into(),
            shape_key: key.split('|').nth(1).unwrap_or("").into(),
            module_path: path.into(),
            inputs: inputs.to_vec(),
        }
    }

    /// embed -> n blocks of (linear, relu, add residual) -> head
    fn stack(n: usize, odd: Option<usize>) -> Vec<BlockNode> {
        let mut nodes = vec![node("embedding|f32[4,8]", "wte", &[])];
        let mut last = 0;
        for b in 0..n {
            let path = format!("h.{b}");
            let w = nodes.len();
            nodes.push(node("param|f32[8,8]", &format!("{path}.fc"), &[]));
            let op = if Some(b) == odd { "gelu" } else { "relu" };
            nodes.push(node("linear|f32[4,8]", &format!("{path}.fc"), &[last, w]));
            nodes.push(node(&format!("{op}|f32[4,8]"), &path, &[w + 1]));
            nodes.push(node("add|f32[4,8]", &path, &[last, w + 2]));
            last = w + 3;
        }
        nodes.push(node("linear|f32[4,2]", "head", &[last]));
        nodes
    }

    #[test]
    fn identical_layers_form_one_class() {
        let classes = detect_blocks(&stack(5, None)).unwrap();
        assert_eq!(classes.len(), 1);
        assert_eq!(classes[0].container, "h");
        assert_eq!(classes[0].instances.len(), 5);
        assert_eq!(classes[0].instances[0], vec![1, 2, 3, 4]);
        assert_eq!(classes[0].instances[4], vec![17, 18, 19, 20]);
    }

    #[test]
    fn a_different_layer_is_its_own_class() {
        let classes = detect_blocks(&stack(5, Some(2))).unwrap();
        assert_eq!(classes.len(), 1); // the gelu layer stands alone (one instance)
        assert_eq!(classes[0].instances.len(), 4);
        assert!(instance_of("encoder.block.3.layer.0").unwrap() == ("encoder.block".into(), 3));
        assert!(instance_of("lm_head").is_none());
        assert!(instance_of("0.fc").is_none());
    }
}
