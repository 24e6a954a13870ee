//! A Kubernetes `Node` object as the strings the state crate validates. Shared by every source,
//! so the file and the API server map nodes exactly the same way.

use k8s_openapi::api::core::v1::Node;
use state::node::RawNode;

/// The fields node-agent uses: name, UID, `status.addresses`, `spec.podCIDRs` (falling back to
/// `spec.podCIDR`), `status.nodeInfo.bootID`. Everything else is ignored.
pub fn raw_node(node: &Node) -> RawNode {
    let meta = &node.metadata;
    let spec = node.spec.as_ref();
    let status = node.status.as_ref();
    let pod_cidrs = spec
        .and_then(|s| s.pod_cidrs.clone())
        .filter(|c| !c.is_empty())
        .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
        .unwrap_or_default();
    RawNode {
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        addresses: status
            .and_then(|s| s.addresses.as_ref())
            .map(|a| {
                a.iter()
                    .map(|a| (a.type_.clone(), a.address.clone()))
                    .collect()
            })
            .unwrap_or_default(),
        pod_cidrs,
        boot_id: status
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.boot_id.clone())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed_node(yaml: &str) -> RawNode {
        raw_node(&serde_saphyr::from_str::<Node>(yaml).unwrap())
    }

    #[test]
    fn maps_the_fields_the_agent_uses() {
        let raw = parsed_node(
            "apiVersion: v1\nkind: Node\nmetadata: {name: n1, uid: u-1}\n\
             spec: {podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24, 'fd00:244:1::/64']}\n\
             status:\n  addresses: [{type: InternalIP, address: 10.0.0.1}, {type: Hostname, address: n1}]\n\
             \x20 nodeInfo: {bootID: b-1, machineID: m, systemUUID: s, kernelVersion: k, osImage: o,\n\
             \x20   containerRuntimeVersion: c, kubeletVersion: v, kubeProxyVersion: v, operatingSystem: linux, architecture: amd64}\n",
        );
        assert_eq!(raw.name, "n1");
        assert_eq!(raw.uid, "u-1");
        assert_eq!(raw.pod_cidrs, ["10.244.1.0/24", "fd00:244:1::/64"]);
        assert_eq!(raw.addresses[0], ("InternalIP".into(), "10.0.0.1".into()));
        assert_eq!(raw.boot_id, "b-1");
    }

    #[test]
    fn falls_back_to_the_single_pod_cidr() {
        let raw = parsed_node(
            "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\nspec: {podCIDR: 10.244.1.0/24}\n",
        );
        assert_eq!(raw.pod_cidrs, ["10.244.1.0/24"]);
        assert!(
            raw.addresses.is_empty(),
            "a registering node has no addresses yet"
        );
    }
}
