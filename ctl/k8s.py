"""k8s/examples: every job spec in examples/ rendered by `ctl render`, for `kubectl apply` and GitOps users.

    python -m ctl.k8s    # (re)write k8s/examples/<example>.yaml for every examples/*.yaml (`make k8s`)

A test fails when a rendered example is stale or has no spec left in examples/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ctl.render import render, to_yaml
from ctl.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
RENDERED = REPO / "k8s" / "examples"


def rendered_example(example: Path) -> str:
    """The file k8s/examples/<name>.yaml holds for examples/<name>.yaml."""
    relative = example.resolve().relative_to(REPO)
    header = (
        f"# Rendered from {relative} by `make k8s` (ctl render {relative}); do not edit.\n"
        f"# Apply with: kubectl apply --server-side -n ddpjob -f k8s/examples/{example.name}\n"
        "# Its image must be one the nodes can pull; with your registry's, render the spec instead:\n"
        f"#   ctl render {relative} --set image.repository=REGISTRY/ddpjob \\\n"
        "#     | kubectl apply --server-side -n ddpjob -f -\n"
    )
    return header + to_yaml(render(load_spec(example, cluster=True)))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m ctl.k8s", description=__doc__.splitlines()[0]).parse_args(argv)
    RENDERED.mkdir(parents=True, exist_ok=True)
    examples = sorted(EXAMPLES.glob("*.yaml"))
    for example in examples:
        target = RENDERED / example.name
        target.write_text(rendered_example(example), encoding="utf-8")
        print(f"wrote {target.relative_to(REPO)}", file=sys.stderr)
    for orphan in sorted(set(RENDERED.glob("*.yaml")) - {RENDERED / e.name for e in examples}):
        orphan.unlink()
        print(f"removed {orphan.relative_to(REPO)} (no examples/{orphan.name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
