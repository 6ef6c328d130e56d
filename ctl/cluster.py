"""ctl against a cluster: targeting like kubectl (kubeconfig, context, namespace), the API transport, server-side
apply, and finding a job of either kind (ctl/kinds). Submitting and deleting are ctl/jobs.py's; a job's state,
pods and progress ctl/status.py's.

Only the Kubernetes API is used (the `kubernetes` client, no kubectl). Every failure that is
not the job's own outcome is a `ClusterError` with one line for the user.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
import yaml
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ctl.kinds import DEFAULT_KIND, KINDS, JobKind
from trainer.failures import first_line

FIELD_MANAGER = "ctl"
DEFAULT_KUBECONFIG = "~/.kube/config"  # kubectl's without --kubeconfig and $KUBECONFIG
# An API server that does not answer is one line after these, not a hang. Reaching it (TCP): kubectl's TLS
# handshake bound; a failed attempt is tried once more (urllib3's default: 3 more, each waiting as long), and so is
# a read without an answer (GET, DELETE; urllib3 sends an apply's PATCH once). A TLS handshake that never ends is
# bounded by the connect timeout but reported by urllib3 as a read's ("no answer from", read timeout=10.0).
CONNECT_TIMEOUT_S = 10.0
CONNECT_RETRIES = 1
READ_TIMEOUT_S = 60.0  # one answer to a request (a list, an apply, a delete), streamed bodies aside
ANSWER_SHOWN = 80  # characters of an answer that is no API object, in its line
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ClusterError(RuntimeError):
    """Talking to the cluster failed; the message is the one line `ctl` prints."""


class KubeconfigError(ClusterError):
    """The kubeconfig, or --context in it, cannot be used: bad input, whatever the cluster."""


class NotFound(ClusterError):
    """The API server answered 404."""


class JobNotFound(NotFound):
    """The job a command names does not exist."""


@dataclass
class Target:
    """An API client and the namespace commands work in."""

    api: ApiClient
    namespace: str
    # Discovery's answer for each API group version this command has asked about: it does not change meanwhile.
    discovered: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    def call(self, path: str, method: str = "GET", **kwargs: Any) -> Any:
        """One API request; the parsed JSON body, a Kubernetes object. API errors become one-line ClusterErrors."""
        with self.errors(method, path):
            answer = self.api.call_api(
                path,
                method,
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),  # a pair: the client ignores a lone float
                **kwargs,
            )
        # Every answer of an API server has its kind (a List, a Status...): not so a login page or another service
        # at the kubeconfig's address, which the client hands on as text, or as JSON of another shape.
        if not isinstance(answer, dict) or "kind" not in answer:
            text = answer if isinstance(answer, str) else json.dumps(answer)
            shown = " ".join(text.split())[:ANSWER_SHOWN] or "nothing"
            raise ClusterError(
                f"{method} {path}: the answer is not a Kubernetes API object ({shown}): is"
                f" {self.api.configuration.host} the API server?"
            )
        return answer

    def open(self, path: str, query: list[tuple[str, str]], timeout: float | None = None) -> urllib3.BaseHTTPResponse:
        """A GET whose body is read as it arrives (a pod's log, a metrics page); the caller closes it.
        `timeout` bounds each read (None: a log followed for hours); reaching the server as every request."""
        with self.errors("GET", path):
            return self.api.call_api(
                path,
                "GET",
                query_params=query,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_S, timeout),
            )

    @contextlib.contextmanager
    def errors(self, method: str, path: str) -> Iterator[None]:
        try:
            yield
        except ApiException as exc:
            if exc.status == 404:
                raise NotFound(f"{method} {path}: not found: {api_message(exc)}") from None
            raise ClusterError(f"{method} {path}: {exc.status} {exc.reason}: {api_message(exc)}") from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # connection refused, DNS, TLS; or no answer in time
            cause = last_try(exc)
            reached = isinstance(cause, urllib3.exceptions.ReadTimeoutError)
            what = "no answer from the API server" if reached else "cannot reach the API server"
            raise ClusterError(f"{what} {self.api.configuration.host}: {unreachable(cause)}") from None


def last_try(exc: Exception) -> Exception:
    """The error of a request's last try (urllib3 wraps it when it was tried more than once)."""
    return exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason else exc


def unreachable(cause: Exception) -> str:
    """Why a request's try got no answer, without urllib3's wrapping (the pool, the URL, the connection object)."""
    if isinstance(cause, urllib3.exceptions.PoolError):  # a read timeout: "<pool>: why", one argument
        return str(cause).removeprefix(f"{cause.pool}: ")
    last = cause.args[-1] if cause.args else None
    return last if isinstance(last, str) and isinstance(cause, urllib3.exceptions.HTTPError) else str(cause)


def api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(exc.body or "").strip()


def connect(kubeconfig: str | None, context: str | None, namespace: str | None) -> Target:
    """Like kubectl: --kubeconfig, else $KUBECONFIG (a list of files), else ~/.kube/config, else in-cluster;
    the namespace from -n, else the context's, else `default` (in a pod: the pod's)."""
    config = kubernetes.config
    if kubeconfig is None and "KUBECONFIG" not in os.environ and not Path(DEFAULT_KUBECONFIG).expanduser().exists():
        if "KUBERNETES_SERVICE_HOST" not in os.environ:
            raise KubeconfigError(
                f"kubeconfig: none found: no {DEFAULT_KUBECONFIG}, $KUBECONFIG is not set, and this"
                " is not a pod (--kubeconfig FILE names one)"
            )
        try:
            configuration = client_configuration()
            config.load_incluster_config(client_configuration=configuration)
            default_namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except (config.ConfigException, OSError) as exc:
            raise ClusterError(f"in-cluster config: {exc}") from None
        return Target(ApiClient(configuration), namespace or default_namespace)
    chosen, api = read_kubeconfig(kubeconfig, context)
    return Target(api, namespace or chosen["context"].get("namespace") or "default")


def client_configuration() -> kubernetes.client.Configuration:
    """The client's settings before the kubeconfig's: how often a connection is tried."""
    configuration = kubernetes.client.Configuration()
    configuration.retries = CONNECT_RETRIES
    return configuration


def read_kubeconfig(kubeconfig: str | None, context: str | None) -> tuple[dict[str, Any], ApiClient]:
    """The context (--context, else the current one) and a client for it, or one line on what is wrong with the
    kubeconfig: a file that is not there, not YAML or not a kubeconfig, a context it does not have."""
    config = kubernetes.config
    if kubeconfig is not None and not Path(kubeconfig).is_file():
        problem = "a directory, not a file" if Path(kubeconfig).is_dir() else "no such file"
        raise KubeconfigError(f"--kubeconfig {kubeconfig}: {problem}")
    files = os.environ.get("KUBECONFIG", "") if kubeconfig is None else kubeconfig  # as the client reads them
    if kubeconfig is None and files and not any(Path(f).expanduser().is_file() for f in files.split(os.pathsep)):
        raise KubeconfigError(f"$KUBECONFIG: none of its files exists ({files})")
    try:
        contexts, active = kubeconfig_contexts(kubeconfig, context)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if chosen is None:
            raise KubeconfigError(f"--context {context!r}: no such context in the kubeconfig")
        user = chosen["context"].get("user")
        with logged_errors() as errors:
            api = config.new_client_from_config(kubeconfig, chosen["name"], client_configuration=client_configuration())
        if errors:  # its credentials plugin (user.exec) failed: the client logs it and goes on without credentials
            raise plugin_failed(user, errors)
        check_server(api.configuration.host, chosen["name"])
        if not api.configuration.verify_ssl:  # insecure-skip-tls-verify, asked for: no warning per request (kubectl's)
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        refresh = api.configuration.refresh_api_key_hook
        if refresh is not None:  # the plugin runs again when its token expires: a long `logs -f`, `wait`
            api.configuration.refresh_api_key_hook = checked_refresh(refresh, user)
        return chosen, api
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark else files or DEFAULT_KUBECONFIG
        problem = getattr(exc, "problem", None) or first_line(exc)
        raise KubeconfigError(f"kubeconfig {where}: not valid YAML: {problem}") from None
    except config.ConfigException as exc:
        raise KubeconfigError(client_problem(str(exc))) from None
    # What the client's loader raises on a file of the wrong shape (a list, a string, base64 that is not).
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise KubeconfigError(
            f"kubeconfig {files or DEFAULT_KUBECONFIG}: not a kubeconfig ({type(exc).__name__}: {exc})"
        ) from None
    except OSError as exc:
        raise KubeconfigError(f"kubeconfig: {exc}") from None


def kubeconfig_contexts(kubeconfig: str | None, context: str | None) -> tuple[list[dict[str, Any]], Any]:
    """The kubeconfig's contexts and its current one. With --context, as kubectl, a kubeconfig without a current
    context, or whose current context is none of its contexts, will do: the client's lister refuses it, its loader
    (private) takes the context to make current."""
    config = kubernetes.config
    try:
        return config.list_kube_config_contexts(config_file=kubeconfig)
    except config.ConfigException as exc:
        if not (context and (NO_CURRENT.match(str(exc)) or NO_SUCH_CURRENT.match(str(exc)))):
            raise
    try:
        loader = config.kube_config._get_kube_config_loader(
            filename=kubeconfig or config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION, active_context=context
        )
    except config.ConfigException:
        raise KubeconfigError(f"--context {context!r}: no such context in the kubeconfig") from None
    return loader.list_contexts(), None


def check_server(host: str, context: str) -> None:
    """The context's cluster's server is a URL: one that is not was a failure to reach it (exit 1), not bad input."""
    try:
        url = urllib3.util.parse_url(host)
    except urllib3.exceptions.LocationParseError:
        url = None
    if url is None or not url.host:
        raise KubeconfigError(f"kubeconfig: context {context!r}: its cluster's server {host!r} is not a URL")


# The client's words for a kubeconfig without the context it makes current, in kubectl's.
NO_SUCH_CURRENT = re.compile(r"Invalid kube-config file\. Expected object with name (.+) in (.+)/contexts list$")
NO_CURRENT = re.compile(r"Invalid kube-config file\. Expected key current-context in (.+)$")


def client_problem(problem: str) -> str:
    """The client's ConfigException as ctl's line."""
    if found := NO_SUCH_CURRENT.match(problem):
        return f"kubeconfig {found[2]}: its current-context {found[1]!r} is none of its contexts (--context names one)"
    if found := NO_CURRENT.match(problem):
        return f"kubeconfig {found[1]}: no current-context (--context names one)"
    return f"kubeconfig: {problem}"


def plugin_failed(user: str | None, errors: list[str]) -> KubeconfigError:
    return KubeconfigError(f"kubeconfig: user {user!r}: its credentials plugin failed: {' '.join(errors[0].split())}")


Refresh = Callable[[kubernetes.client.Configuration], None]


def checked_refresh(refresh: Refresh, user: str | None) -> Refresh:
    """The client's refresh of an expired token, where a failed plugin ends the command in ctl's one line: the
    client would log it and send the expired token."""

    def checked(configuration: kubernetes.client.Configuration) -> None:
        with logged_errors() as errors:
            refresh(configuration)
        if errors:
            raise plugin_failed(user, errors)

    return checked


@contextlib.contextmanager
def logged_errors() -> Iterator[list[str]]:
    """The messages logged at ERROR meanwhile, taken from the log: printed, they would come before ctl's one line,
    and Python's first print of a log record also sets up the printing of every later warning (urllib3's retries)."""
    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    root = logging.getLogger()
    handler = Collect(logging.ERROR)
    root.addHandler(handler)
    try:
        yield errors
    finally:
        root.removeHandler(handler)


def resource_path(target: Target, obj: dict[str, Any]) -> str:
    """The object's URL, its resource name found through discovery (as kubectl does)."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if base not in target.discovered:
        try:
            target.discovered[base] = target.call(base)["resources"]
        except NotFound:
            raise ClusterError(f"the cluster does not serve {api_version} (for {kind})") from None
    (resource,) = [r for r in target.discovered[base] if r["kind"] == kind and "/" not in r["name"]]
    scope = f"/namespaces/{target.namespace}" if resource["namespaced"] else ""
    return f"{base}{scope}/{resource['name']}/{obj['metadata']['name']}"


def apply(target: Target, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
    """Server-side apply (field manager `ctl`), in the target namespace; the object as stored."""
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
    return target.call(
        resource_path(target, obj),
        "PATCH",
        query_params=query,
        header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
        body=obj,
    )


def merge_patch(target: Target, path: str, patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of the object at the path (field manager `ctl`), as `kubectl patch --type merge`: only the
    fields it names change, where an apply would drop the fields ctl applied before; the object as stored."""
    return target.call(
        path,
        "PATCH",
        query_params=[("fieldManager", FIELD_MANAGER)],
        header_params={"Content-Type": "application/merge-patch+json", "Accept": "application/json"},
        body=patch,
    )


def exists(target: Target, path: str) -> bool:
    """Whether the cluster has the object at the path (a GET that finds nothing is a no)."""
    try:
        target.call(path)
    except NotFound:
        return False
    return True


def get_job(target: Target, name: str, api: JobKind = DEFAULT_KIND) -> dict[str, Any]:
    try:
        return target.call(api.path(target.namespace, name))
    except NotFound:
        raise JobNotFound(f"{api.kind.lower()} {name} not found in namespace {target.namespace}") from None


def find_job(target: Target, name: str) -> dict[str, Any]:
    """The job of that name, of whichever kind the cluster has it as (PyTorchJob first)."""
    for api in KINDS.values():
        try:
            return target.call(api.path(target.namespace, name))
        except NotFound:  # no such job, or no such resource in this cluster
            continue
    if not any(serves(target, api) for api in KINDS.values()):  # the root cause: no operator, not a missing job
        require_operator(target)
    raise JobNotFound(f"job {name} not found in namespace {target.namespace} (neither PyTorchJob nor TrainJob)")


def serves(target: Target, api: JobKind) -> bool:
    """Whether the cluster serves the kind (its CRD installed)."""
    try:
        resources = target.call(f"/apis/{api.api_version}")["resources"]
    except NotFound:
        return False
    return any(r["name"] == api.plural for r in resources)


def require_operator(target: Target, api: JobKind = DEFAULT_KIND) -> None:
    if not serves(target, api):
        raise ClusterError(f"the cluster has no {api.kind} resource ({api.plural}.{api.group}): install {api.install}")
