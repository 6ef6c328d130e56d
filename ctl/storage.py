"""Will the run directory's claim bind? A multi-node job's claim asks ReadWriteMany, which the default storage
classes of EKS, GKE and AKS (block disks attached to one node at a time) cannot give: the claim then stays Pending
and the job waits forever without a word. `ctl submit` checks the class against the cluster before creating
anything; `ctl render`, without a cluster, notes the risk when the claim relies on the default class.

What is checked is read from the rendered claim (its access modes follow the node count in the chart). No
Kubernetes client here: `ctl render` imports this module; ctl.jobs.check_claim asks the cluster.
"""

from __future__ import annotations

from typing import Any

RWX = "ReadWriteMany"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
# Provisioners of block volumes that attach to one node at a time: they never provision ReadWriteMany.
RWO_ONLY_PROVISIONERS = {
    "ebs.csi.aws.com": "AWS EBS",
    "kubernetes.io/aws-ebs": "AWS EBS",
    "pd.csi.storage.gke.io": "GCE persistent disk",
    "kubernetes.io/gce-pd": "GCE persistent disk",
    "disk.csi.azure.com": "Azure Disk",
    "kubernetes.io/azure-disk": "Azure Disk",
    "cinder.csi.openstack.org": "OpenStack Cinder",
    "dobs.csi.digitalocean.com": "DigitalOcean block storage",
    "rancher.io/local-path": "local-path",
}
CHOICES = (
    "set storage.storageClassName to a ReadWriteMany class (EFS, Filestore, Azure Files, an NFS provisioner:"
    " see k8s/README.md) or storage.existingClaim to a shared claim"
)


def rwx_claim(objects: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rendered PersistentVolumeClaim when it asks ReadWriteMany (none with storage.existingClaim)."""
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim" and RWX in o["spec"]["accessModes"]]
    return claims[0] if claims else None


def render_note(objects: list[dict[str, Any]]) -> str | None:
    """`ctl render`'s note when the claim asks ReadWriteMany of the cluster's default class, unknown here."""
    claim = rwx_claim(objects)
    if claim is None or claim["spec"].get("storageClassName"):
        return None
    return (
        f"note: claim {claim['metadata']['name']} asks {RWX} of the cluster's default storage class; the defaults"
        f" of EKS, GKE and AKS give ReadWriteOnce only and it would never bind there: {CHOICES}"
    )


def mismatch(claim: dict[str, Any], storage_class: dict[str, Any], default: bool) -> str | None:
    """The one-line problem when `storage_class` cannot give the ReadWriteMany `claim`; None when it may."""
    provisioner = storage_class.get("provisioner", "")
    if provisioner not in RWO_ONLY_PROVISIONERS:
        return None
    which = f"storage class {storage_class['metadata']['name']}" + (" (the cluster's default)" if default else "")
    return (
        f"storage: claim {claim['metadata']['name']} asks {RWX}, which {which} cannot give (its provisioner"
        f" {provisioner}, {RWO_ONLY_PROVISIONERS[provisioner]}, attaches a volume to one node at a time), so it"
        f" would never bind: {CHOICES}"
    )
