//! Graph linearization (MAP section 5.2.2-5.2.4, Algorithm 2): cut a DAG
//! into a chain of stages for the rotor checkpointing DP.
//!
//! Nodes are visited in topological order and appended to the open stage.
//! Each visited node releases one dependency on each parent and registers
//! one per child; when no dependency is pending the stage may close (its
//! last node is then the only tensor the rest of the graph needs), unless a
//! child of the node is in-place or a communication node, which must stay
//! with its parent. Common nodes (non-differentiable values such as masks
//! and positions, and nodes all of whose parents are common: Definition 5.3,
//! Lemma 5.4) register no dependencies, so constants used by every layer do
//! not hold one giant stage open. Placeholders (parameters, inputs) belong to
//! no stage.

use crate::error::{check_earlier, Result};

/// What linearization needs to know about one node (graph order).
#[derive(Debug, Clone, Default)]
pub struct LinearNode {
    pub parents: Vec<usize>,
    pub placeholder: bool,
    /// Yields no differentiable value (bool masks, integer positions...).
    pub non_differentiable: bool,
    pub inplace: bool,
    pub communication: bool,
}

/// Definition 5.3 and Lemma 5.4: non-differentiable nodes, and nodes all of
/// whose (at least one) parents are common. Parents must come first.
fn common_nodes(nodes: &[LinearNode]) -> Vec<bool> {
    let mut common = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        common[i] = node.non_differentiable
            || (!node.parents.is_empty() && node.parents.iter().all(|&p| common[p]));
    }
    common
}

/// The stages: lists of node indices (placeholders excluded), in order.
/// Every node's parents must be earlier nodes.
pub fn linearize(nodes: &[LinearNode]) -> Result<Vec<Vec<usize>>> {
    check_earlier(
        "linearize: the parents",
        nodes.iter().map(|n| n.parents.as_slice()),
    )?;
    let common = common_nodes(nodes);
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        for &p in &node.parents {
            children[p].push(i);
        }
    }
    // Pending dependencies per node, and how many nodes have some pending.
    let mut pending = vec![0usize; nodes.len()];
    let mut open = 0usize;
    let mut stages = Vec::new();
    let mut current = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if node.placeholder {
            continue;
        }
        for &p in &node.parents {
            if pending[p] > 0 {
                pending[p] -= 1;
                if pending[p] == 0 {
                    open -= 1;
                }
            }
        }
        // Nothing else pending: only this node's output flows on, a cut point.
        let cut = open == 0;
        if !common[i] {
            let deps = children[i].iter().filter(|&&c| !common[c]).count();
            if deps > 0 {
                pending[i] = deps;
                open += 1;
            }
        }
        current.push(i);
        let sticky = children[i]
            .iter()
            .any(|&c| nodes[c].inplace || nodes[c].communication);
        // Close only after a differentiable node: a stage ends in the tensor it hands on.
        if cut && !sticky && !common[i] {
            stages.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        match stages.last_mut() {
            // Trailing common nodes (e.g. a final assert) join the last stage.
            Some(last) if current.iter().all(|&i| common[i]) => last.extend(current),
            _ => stages.push(current),
        }
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(parents: &[usize]) -> LinearNode {
        LinearNode {
            parents: parents.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn a_chain_is_one_stage_per_node() {
        let nodes = vec![node(&[]), node(&[0]), node(&[1]), node(&[2])];
        assert_eq!(
            linearize(&nodes).unwrap(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
    }

    #[test]
    fn residual_blocks_close_at_the_add() {
        // x -> conv -> relu -> add(x, relu) -> conv -> add(...)
        let nodes = vec![
            node(&[]),
            node(&[0]),
            node(&[1]),
            node(&[0, 2]),
            node(&[3]),
            node(&[3, 4]),
        ];
        assert_eq!(
            linearize(&nodes).unwrap(),
            vec![vec![0], vec![1, 2, 3], vec![4, 5]]
        );
    }

    #[test]
    fn a_mask_used_everywhere_does_not_hold_stages_open() {
        // 0: input ids (placeholder), 1: mask (non-differentiable), then a chain reading the mask.
        let mut nodes = vec![LinearNode {
            placeholder: true,
            ..Default::default()
        }];
        nodes.push(LinearNode {
            parents: vec![0],
            non_differentiable: true,
            ..Default::default()
        });
        nodes.push(node(&[0])); // embedding
        nodes.push(node(&[2, 1]));
        nodes.push(node(&[3, 1]));
        nodes.push(node(&[1])); // derived from the mask only: common
        nodes.push(node(&[4, 5]));
        let common = common_nodes(&nodes);
        assert!(common[1] && common[5] && !common[4]);
        assert_eq!(
            linearize(&nodes).unwrap(),
            vec![vec![1, 2], vec![3], vec![4], vec![5, 6]]
        );
    }

    #[test]
    fn inplace_children_stay_with_their_parent() {
        let mut nodes = vec![node(&[]), node(&[0]), node(&[1]), node(&[2])];
        nodes[2].inplace = true; // relu_ after batch norm
        assert_eq!(
            linearize(&nodes).unwrap(),
            vec![vec![0], vec![1, 2], vec![3]]
        );
    }
}
