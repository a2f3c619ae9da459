// Validates the deployment configs (`make validate-deploy`, part of `make test`):
//  1. every YAML document under envoy/istio, envoy/gie and deploy/ against its schema, chosen by
//     apiVersion/kind (kubernetes-models, @kubernetes-models/istio, @kubernetes-models/gateway-api,
//     and our JSON schemas for InferencePool, Kustomization, ServiceMonitor, PodMonitor and
//     PrometheusRule, which reject unknown fields; the Istio and Gateway API kinds' field names
//     against *.strict.schema.json too); an unknown kind is an error;
//  2. every EnvoyFilter applied whole to a proxy configuration as Istio builds one (HTTP filter
//     inserted, virtual host, cluster and listener merged), checked with the real Envoy's
//     `envoy --mode validate`;
//  3. docker/*.Dockerfile syntax (known instructions, stages, COPY --from, cargo -p packages)
//     and that .dockerignore exists;
//  4. kustomization resources exist;
//  5. every Kustomization rendered with `kubectl kustomize`, and the rendered objects and every
//     file's built-in kinds validated strictly (unknown fields are errors) by kubernetes-validate
//     (KUBE_VALIDATE, default .venv/bin/kubernetes-validate);
//  6. selectors: a workload's selector matches its own pod template, and every Service,
//     PodDisruptionBudget and NetworkPolicy selects some pod template rendered beside it;
//  7. a self-test: misspelled fields and a selector matching nothing, planted in copies of the
//     rendered objects, must each fail 5 or 6 (a validator that cannot fail proves nothing).
// Usage: node validate.mjs [EXTRA.yaml ...]   (extra files are checked too, e.g. a broken one).
// ENVOY_BIN selects Envoy (default .venv/bin/envoy). Exits 1 on any failure.
import { readFileSync, readdirSync, statSync, existsSync, mkdtempSync, writeFileSync, rmSync } from "node:fs";
import { join, relative, dirname, basename } from "node:path";
import { tmpdir } from "node:os";
import { execFileSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { parseAllDocuments } from "yaml";
import Ajv from "ajv";

const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const ENVOY = process.env.ENVOY_BIN || join(ROOT, ".venv", "bin", "envoy");
const KUBE_VALIDATE = process.env.KUBE_VALIDATE || join(ROOT, ".venv", "bin", "kubernetes-validate");
const failures = [];
const fail = (where, msg) => failures.push(`${where}: ${msg}`);

// ---- which YAML files -------------------------------------------------------------------------
function yamlFiles(dir) {
  const out = [];
  if (!existsSync(dir)) return out;
  for (const name of readdirSync(dir).sort()) {
    const p = join(dir, name);
    if (name === "node_modules") continue;
    if (statSync(p).isDirectory()) out.push(...yamlFiles(p));
    else if (/\.ya?ml$/.test(name)) out.push(p);
  }
  return out;
}
const files = [
  ...["envoy/istio", "envoy/gie", "deploy"].flatMap((d) => yamlFiles(join(ROOT, d))),
  ...process.argv.slice(2),
];

// ---- schemas by apiVersion/kind ---------------------------------------------------------------
const ajv = new Ajv({ allErrors: true, strict: false });
const ownSchemas = {
  "inference.networking.k8s.io/v1/InferencePool": "inferencepool.schema.json",
  "kustomize.config.k8s.io/v1beta1/Kustomization": "kustomization.schema.json",
  "monitoring.coreos.com/v1/ServiceMonitor": "servicemonitor.schema.json",
  "monitoring.coreos.com/v1/PodMonitor": "podmonitor.schema.json",
  "monitoring.coreos.com/v1/PrometheusRule": "prometheusrule.schema.json",
};
const here = dirname(fileURLToPath(import.meta.url));
const ISTIO_GROUPS = ["networking.istio.io", "security.istio.io", "extensions.istio.io", "telemetry.istio.io"];

// Field-name checks for the Istio and Gateway API kinds, on top of kubernetes-models (whose
// validators allow unknown fields).
const strictSchemas = {
  "networking.istio.io/v1alpha3/EnvoyFilter": "envoyfilter.strict.schema.json",
  "networking.istio.io/v1/DestinationRule": "destinationrule.strict.schema.json",
  "networking.istio.io/v1/ServiceEntry": "serviceentry.strict.schema.json",
  "gateway.networking.k8s.io/v1/HTTPRoute": "httproute.strict.schema.json",
};
const strictChecks = new Map();
function strictFieldErrors(obj) {
  const file = strictSchemas[`${obj.apiVersion}/${obj.kind}`];
  if (!file) return null;
  if (!strictChecks.has(file)) strictChecks.set(file, ajv.compile(JSON.parse(readFileSync(join(here, file), "utf8"))));
  const check = strictChecks.get(file);
  return check(obj) ? [] : [ajv.errorsText(check.errors, { dataVar: "" })];
}

async function modelFor(apiVersion, kind) {
  const own = ownSchemas[`${apiVersion}/${kind}`];
  if (own) {
    const check = ajv.compile(JSON.parse(readFileSync(join(here, own), "utf8")));
    return (obj) => {
      if (!check(obj)) throw new Error(ajv.errorsText(check.errors, { dataVar: "" }));
    };
  }
  const group = apiVersion.includes("/") ? apiVersion.split("/")[0] : "";
  let mod;
  if (ISTIO_GROUPS.includes(group)) mod = `@kubernetes-models/istio/${apiVersion}`;
  else if (group === "gateway.networking.k8s.io") mod = `@kubernetes-models/gateway-api/${apiVersion}`;
  else mod = `kubernetes-models/${apiVersion}`;
  let exports;
  try {
    exports = await import(mod);
  } catch {
    return null;
  }
  const Model = exports[kind];
  if (typeof Model !== "function") return null;
  return (obj) => new Model(obj).validate();
}

// ---- Envoy checks ----------------------------------------------------------------------------
let bootstraps = 0;
const tmp = mkdtempSync(join(tmpdir(), "llmgw-validate-"));

// Whether Envoy accepts `bootstrap`; a refusal is a failure unless `quiet` (the self-test).
function envoyValidate(where, bootstrap, quiet = false) {
  bootstraps++;
  const path = join(tmp, `bootstrap-${bootstraps}.json`);
  writeFileSync(path, JSON.stringify(bootstrap, null, 1));
  try {
    execFileSync(ENVOY, ["--mode", "validate", "-c", path, "--log-level", "error"], {
      stdio: "pipe",
      timeout: 60_000,
    });
    return true;
  } catch (e) {
    const out = `${e.stdout || ""}${e.stderr || ""}`.trim().split("\n").slice(-6).join("\n");
    if (!quiet) fail(where, `envoy --mode validate failed: ${out || e.message}`);
    return false;
  }
}

// The ext_proc filter's gRPC cluster(s), so the bootstrap names them.
function grpcClusters(value, acc = new Set()) {
  if (value && typeof value === "object") {
    if (typeof value.cluster_name === "string") acc.add(value.cluster_name);
    for (const v of Object.values(value)) grpcClusters(v, acc);
  }
  return acc;
}
const h2Cluster = (name) => ({
  name,
  type: "STATIC",
  connect_timeout: "1s",
  typed_extension_protocol_options: {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
      "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
      explicit_http_config: { http2_protocol_options: {} },
    },
  },
  load_assignment: {
    cluster_name: name,
    endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: "127.0.0.1", port_value: 9002 } } } }] }],
  },
});
// Istio's MERGE is a proto merge: messages merge field by field, repeated fields append.
function merge(base, patch) {
  if (Array.isArray(base) && Array.isArray(patch)) return [...base, ...patch];
  if (base && patch && typeof base === "object" && typeof patch === "object" && !Array.isArray(base)) {
    const out = { ...base };
    for (const [k, v] of Object.entries(patch)) out[k] = k in base ? merge(base[k], v) : v;
    return out;
  }
  return patch;
}

const ROUTER_FILTER = { name: "envoy.filters.http.router", typed_config: { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" } };
const UPSTREAM = { name: "upstream", type: "STATIC", connect_timeout: "1s", load_assignment: { cluster_name: "upstream", endpoints: [] } };

// A listener with one HTTP connection manager routing everything to `upstream` through `httpFilters`.
function hcmListener(httpFilters, virtualHosts) {
  return {
    name: "l",
    address: { socket_address: { address: "127.0.0.1", port_value: 10000 } },
    filter_chains: [{ filters: [{
      name: "envoy.filters.network.http_connection_manager",
      typed_config: {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix: "l",
        route_config: { virtual_hosts: virtualHosts || [{ name: "v", domains: ["*"], routes: [{ match: { prefix: "/" }, route: { cluster: "upstream" } }] }] },
        http_filters: httpFilters,
      },
    }] }],
  };
}

// The whole EnvoyFilter applied to a proxy as Istio builds one, then `envoy --mode validate` on
// it: an HTTP connection manager whose route configuration has each virtual host a patch names
// (and one other), ending in the router filter; the vLLM Service's EDS cluster (lb_policy
// LEAST_REQUEST, Istio's default), replaced by a STATIC one with two endpoints. Patches apply in
// order: HTTP_FILTER INSERT_BEFORE the router, VIRTUAL_HOST / CLUSTER / LISTENER MERGE. So a
// per-route config for a filter that is not inserted, or a field Envoy does not know, fails.
function checkEnvoyFilter(where, obj, quiet = false) {
  const patches = obj.spec?.configPatches || [];
  const route = { match: { prefix: "/" }, route: { cluster: "outbound|8000||vllm" } };
  const virtualHosts = patches
    .filter((p) => p.applyTo === "VIRTUAL_HOST")
    .map((p) => p.match?.routeConfiguration?.vhost?.name)
    .filter(Boolean)
    .map((name) => ({ name, domains: [name.split(":")[0]], routes: [route] }));
  virtualHosts.push({ name: "other", domains: ["*"], routes: [{ match: { prefix: "/" }, route: { cluster: "upstream" } }] });
  let httpFilters = [ROUTER_FILTER];
  let cluster = {
    name: "outbound|8000||vllm",
    type: "STATIC",
    connect_timeout: "1s",
    lb_policy: "LEAST_REQUEST",
    load_assignment: {
      cluster_name: "outbound|8000||vllm",
      endpoints: [{ lb_endpoints: [8001, 8002].map((port_value) => ({ endpoint: { address: { socket_address: { address: "127.0.0.1", port_value } } } })) }],
    },
  };
  let listenerPatch = null;
  const grpc = new Set();
  patches.forEach((p, i) => {
    const at = `${where} configPatches[${i}] ${p.applyTo}`;
    const value = p.patch?.value;
    if (!value) return;
    const op = p.patch.operation;
    if (p.applyTo === "HTTP_FILTER") {
      if (op !== "INSERT_BEFORE") return fail(at, `no check for ${op}; add one to validate.mjs`);
      grpcClusters(value, grpc);
      httpFilters = [...httpFilters.slice(0, -1), value, ROUTER_FILTER];
    } else if (p.applyTo === "VIRTUAL_HOST") {
      if (op !== "MERGE") return fail(at, `no check for ${op}; add one to validate.mjs`);
      const name = p.match?.routeConfiguration?.vhost?.name;
      if (!name) return fail(at, "matches no virtual host by name (every host of every gateway)");
      const i = virtualHosts.findIndex((v) => v.name === name);
      virtualHosts[i] = merge(virtualHosts[i], value);
    } else if (p.applyTo === "CLUSTER") {
      cluster = op === "MERGE" ? merge(cluster, value) : value;
    } else if (p.applyTo === "LISTENER") {
      listenerPatch = value;
    } else {
      fail(at, "no Envoy check for this applyTo; add one to validate.mjs");
    }
  });
  // Envoy accepts a per-host config for a filter that is not there; it would leave ours off.
  const inserted = new Set(httpFilters.map((f) => f.name));
  const enabled = new Set(virtualHosts.flatMap((v) => Object.keys(v.typed_per_filter_config || {})));
  let consistent = true;
  for (const name of enabled)
    if (!inserted.has(name)) {
      consistent = false;
      if (!quiet) fail(where, `a virtual host configures ${name}, which no patch inserts`);
    }
  for (const f of httpFilters)
    if (f.disabled && !enabled.has(f.name)) {
      consistent = false;
      if (!quiet) fail(where, `${f.name} is inserted disabled and no virtual host turns it on`);
    }
  let listener = hcmListener(httpFilters, virtualHosts);
  if (listenerPatch) listener = merge(listener, listenerPatch);
  const clusters = [...grpc].map(h2Cluster);
  clusters.push(UPSTREAM, cluster);
  return envoyValidate(where, { static_resources: { listeners: [listener], clusters } }, quiet) && consistent;
}

// ---- Dockerfiles -----------------------------------------------------------------------------
const INSTRUCTIONS = new Set(["FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"]);
function workspacePackages() {
  const names = new Set();
  for (const toml of ["Cargo.toml", "agent/Cargo.toml", "integration/Cargo.toml", "proto/Cargo.toml"]) {
    const p = join(ROOT, toml);
    if (!existsSync(p)) continue;
    const m = readFileSync(p, "utf8").match(/\[package\][^[]*?\bname\s*=\s*"([^"]+)"/);
    if (m) names.add(m[1]);
  }
  return names;
}
let dockerfiles = 0;
function checkDockerfile(path) {
  dockerfiles++;
  const where = relative(ROOT, path);
  // Logical lines (continuations joined), each with the physical line it starts on.
  const logical = [];
  let start = -1;
  let acc = "";
  readFileSync(path, "utf8").split("\n").forEach((phys, i) => {
    if (start < 0) start = i;
    if (/\\\s*$/.test(phys)) acc += phys.replace(/\\\s*$/, " ");
    else {
      logical.push([start, acc + phys]);
      start = -1;
      acc = "";
    }
  });
  const stages = new Set();
  const packages = workspacePackages();
  let sawFrom = false;
  logical.forEach(([n, raw]) => {
    const line = raw.trim();
    if (!line || line.startsWith("#")) return;
    const [word, ...rest] = line.split(/\s+/);
    const ins = word.toUpperCase();
    if (!INSTRUCTIONS.has(ins)) return fail(`${where}:${n + 1}`, `unknown instruction ${word}`);
    if (ins !== word) fail(`${where}:${n + 1}`, `instruction ${word} not upper case`);
    if (!sawFrom && ins !== "FROM" && ins !== "ARG") fail(`${where}:${n + 1}`, `${ins} before the first FROM`);
    if (rest.length === 0) fail(`${where}:${n + 1}`, `${ins} without arguments`);
    if (ins === "FROM") {
      sawFrom = true;
      const args = rest.filter((a) => !a.startsWith("--"));
      if (args.length === 3 && args[1].toUpperCase() === "AS") stages.add(args[2]);
      else if (args.length !== 1) fail(`${where}:${n + 1}`, "FROM IMAGE [AS NAME] expected");
      else if (stages.has(args[0])) {/* FROM an earlier stage */}
    }
    if (ins === "COPY" || ins === "ADD") {
      const from = rest.find((a) => a.startsWith("--from="));
      if (from && !stages.has(from.slice(7))) fail(`${where}:${n + 1}`, `COPY ${from}: no earlier stage named so`);
      if (rest.filter((a) => !a.startsWith("--")).length < 2) fail(`${where}:${n + 1}`, `${ins} needs a source and a destination`);
    }
    if (ins === "RUN") {
      for (const m of line.matchAll(/cargo build[^&;]*?(?:-p|--package)\s+(\S+)/g))
        if (!packages.has(m[1])) fail(`${where}:${n + 1}`, `cargo -p ${m[1]}: not a workspace package`);
    }
  });
  if (!sawFrom) fail(where, "no FROM");
}

// ---- strict validation of built-in kinds, kustomize rendering, selectors --------------------
// kubernetes-validate --strict on `path`; the ERROR lines, empty when it passed.
function strictErrors(path) {
  try {
    execFileSync(KUBE_VALIDATE, ["--strict", "--quiet", "--no-warn", path], { stdio: "pipe" });
    return [];
  } catch (e) {
    if (e.code === "ENOENT") return [`${KUBE_VALIDATE} not found (make validate-deploy installs it)`];
    const out = `${e.stdout ?? ""}${e.stderr ?? ""}`;
    const errors = out.split("\n").filter((l) => l.startsWith("ERROR"));
    return errors.length ? errors : [out.trim() || `exit ${e.status}`];
  }
}

// The directories under deploy/ with a kustomization.yaml.
function kustomizationDirs(dir) {
  const out = [];
  if (!existsSync(dir)) return out;
  if (existsSync(join(dir, "kustomization.yaml"))) out.push(dir);
  for (const name of readdirSync(dir).sort()) {
    const p = join(dir, name);
    if (name !== "node_modules" && name !== "validate" && statSync(p).isDirectory()) out.push(...kustomizationDirs(p));
  }
  return out;
}

const WORKLOADS = new Set(["Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"]);
const matches = (selector, labels) => Object.entries(selector || {}).every(([k, v]) => (labels || {})[k] === v);

// Selector problems in one set of objects rendered together.
function selectorErrors(objs) {
  const errors = [];
  const templates = [];
  for (const o of objs) {
    if (!WORKLOADS.has(o.kind)) continue;
    const name = `${o.kind} ${o.metadata?.name}`;
    const labels = o.spec?.template?.metadata?.labels;
    const selector = o.spec?.selector?.matchLabels;
    if (!selector || !Object.keys(selector).length) errors.push(`${name}: no spec.selector.matchLabels`);
    else if (!matches(selector, labels)) errors.push(`${name}: spec.selector ${JSON.stringify(selector)} does not match its pod template's labels ${JSON.stringify(labels)}`);
    templates.push({ namespace: o.metadata?.namespace, labels });
  }
  const selects = (o, selector) =>
    templates.some((t) => t.namespace === o.metadata?.namespace && matches(selector, t.labels));
  for (const o of objs) {
    const name = `${o.kind} ${o.metadata?.name}`;
    let selector = null;
    if (o.kind === "Service") selector = o.spec?.selector;
    if (o.kind === "PodDisruptionBudget") selector = o.spec?.selector?.matchLabels;
    if (o.kind === "NetworkPolicy") selector = o.spec?.podSelector?.matchLabels;
    if (selector && Object.keys(selector).length && !selects(o, selector))
      errors.push(`${name}: selector ${JSON.stringify(selector)} matches no pod template beside it`);
  }
  return errors;
}

function parseObjects(text) {
  return parseAllDocuments(text).map((d) => d.toJSON()).filter((o) => o != null);
}

let rendered = 0;
const renderedSets = [];
function checkKustomization(dir) {
  const where = `kubectl kustomize ${relative(ROOT, dir) || "."}`;
  let text;
  try {
    text = execFileSync("kubectl", ["kustomize", dir], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    return fail(where, `${e.stderr || e.message}`.trim());
  }
  rendered++;
  const path = join(tmp, `rendered-${rendered}.yaml`);
  writeFileSync(path, text);
  for (const e of strictErrors(path)) fail(where, e);
  const objs = parseObjects(text);
  for (const e of selectorErrors(objs)) fail(where, e);
  renderedSets.push({ where, text });
}

// Each mutation of a rendered set must be caught; returns what was not.
function selfTest() {
  const missed = [];
  const base = renderedSets.find((r) => r.text.includes("readinessProbe") && r.text.includes("targetPort"));
  if (!base) return ["no rendered set with a readinessProbe and a Service targetPort to mutate"];
  const mutations = [
    ["readinessProbe → readinesProbe", (t) => t.replace("readinessProbe:", "readinesProbe:")],
    ["Service targetPort → targetPrt", (t) => t.replace("targetPort:", "targetPrt:")],
    ["spec.replicas → spec.replica", (t) => t.replace(/\n  replicas: /, "\n  replica: ")],
    ["containerPort → containerPrt", (t) => t.replace("containerPort:", "containerPrt:")],
  ];
  mutations.forEach(([name, mutate], i) => {
    const text = mutate(base.text);
    if (text === base.text) return missed.push(`${name}: nothing to mutate`);
    const path = join(tmp, `mutated-${i}.yaml`);
    writeFileSync(path, text);
    if (strictErrors(path).length === 0) missed.push(`${name}: passed strict validation`);
  });
  // A workload whose pod template lost its labels: its selector and its Service's match nothing.
  const objs = parseObjects(base.text);
  const workload = objs.find((o) => WORKLOADS.has(o.kind));
  if (workload) {
    workload.spec.template.metadata.labels = { "app.kubernetes.io/name": "renamed" };
    if (selectorErrors(objs).length === 0) missed.push("pod template relabelled: selectors still pass");
  } else missed.push("no workload to relabel");
  // The Istio and Gateway API kinds' field names are checked.
  const gatewayKinds = [
    ["EnvoyFilter configPatches → configPatchs", "envoy/istio/gateway-envoyfilter.yaml", "configPatches:", "configPatchs:"],
    ["HTTPRoute backendRefs → backendRef", "envoy/gie/httproute.yaml", "backendRefs:", "backendRef:"],
    ["DestinationRule trafficPolicy → trafficPolcy", "envoy/istio/destinationrule.yaml", "trafficPolicy:", "trafficPolcy:"],
  ];
  for (const [name, file, from, to] of gatewayKinds) {
    const path = join(ROOT, file);
    if (!existsSync(path)) { missed.push(`${name}: ${file} is missing`); continue; }
    const mutated = parseObjects(readFileSync(path, "utf8").replace(from, to));
    if (mutated.every((o) => (strictFieldErrors(o) ?? []).length === 0)) missed.push(`${name}: passed`);
  }
  // The EnvoyFilters' Envoy configuration is checked whole: a misspelled Envoy field, and a
  // per-host config naming a filter the patches do not insert, are refused.
  const envoyMutations = [
    ["ext_proc disabled → disabeld", "disabled: true", "disabeld: true"],
    ["per-host config for another filter", "          envoy.filters.http.ext_proc:\n", "          envoy.filters.http.ext_authz:\n"],
    ["request_body_buffer_limit → request_body_buffer_limt", "request_body_buffer_limit:", "request_body_buffer_limt:"],
  ];
  for (const file of ["envoy/istio/gateway-envoyfilter.yaml", "envoy/istio/sidecar-envoyfilter.yaml"]) {
    const text = readFileSync(join(ROOT, file), "utf8");
    for (const [name, from, to] of envoyMutations) {
      if (!text.includes(from)) { missed.push(`${file} ${name}: nothing to mutate`); continue; }
      const [filter] = parseObjects(text.replace(from, to));
      if (checkEnvoyFilter(`self-test ${file}`, filter, true)) missed.push(`${file} ${name}: Envoy accepted it`);
    }
  }
  // Our own CRD schemas are strict too.
  const pool = { apiVersion: "inference.networking.k8s.io/v1", kind: "InferencePool", metadata: { name: "p" },
    spec: { selector: { matchLabels: { app: "v" } }, targetPort: [{ number: 8000 }], endpointPickerRef: { name: "e" } } };
  const check = ajv.compile(JSON.parse(readFileSync(join(here, ownSchemas["inference.networking.k8s.io/v1/InferencePool"]), "utf8")));
  if (check(pool)) missed.push("InferencePool targetPorts → targetPort: passed its schema");
  return missed;
}

// ---- run -------------------------------------------------------------------------------------
let documents = 0;
const kinds = new Map();
for (const file of files) {
  const where = relative(ROOT, file);
  let docs;
  try {
    docs = parseAllDocuments(readFileSync(file, "utf8"));
  } catch (e) {
    fail(where, e.message);
    continue;
  }
  for (const [i, doc] of docs.entries()) {
    const at = `${where}#${i}`;
    if (doc.errors.length) {
      fail(at, doc.errors.map((e) => e.message).join("; "));
      continue;
    }
    const obj = doc.toJSON();
    if (obj == null) continue;
    documents++;
    const { apiVersion, kind } = obj;
    if (!apiVersion || !kind) {
      fail(at, "no apiVersion/kind");
      continue;
    }
    const validate = await modelFor(apiVersion, kind);
    if (!validate) {
      fail(at, `unknown kind ${apiVersion} ${kind}`);
      continue;
    }
    kinds.set(`${apiVersion} ${kind}`, (kinds.get(`${apiVersion} ${kind}`) || 0) + 1);
    try {
      validate(obj);
    } catch (e) {
      fail(`${at} ${kind} ${obj.metadata?.name ?? ""}`, e.message);
    }
    for (const e of strictFieldErrors(obj) ?? []) fail(`${at} ${kind} ${obj.metadata?.name ?? ""}`, e);
    if (kind === "EnvoyFilter") checkEnvoyFilter(`${at} EnvoyFilter ${obj.metadata?.name}`, obj);
    if (kind === "Kustomization")
      for (const r of obj.resources || []) if (!existsSync(join(dirname(file), r))) fail(at, `resource ${r} does not exist`);
  }
}
// Built-in kinds of every file, strictly (CRDs are left to the schemas above).
for (const file of files) for (const e of strictErrors(file)) fail(relative(ROOT, file), e);
for (const dir of kustomizationDirs(join(ROOT, "deploy"))) checkKustomization(dir);
// The GIE picker's manifest stands alone: its Service must select its Deployment.
for (const file of files.filter((f) => f.includes(`${join("envoy", "gie")}`)))
  for (const e of selectorErrors(parseObjects(readFileSync(file, "utf8")))) fail(relative(ROOT, file), e);
const missed = selfTest();
for (const m of missed) fail("self-test", `a planted error was not caught: ${m}`);

const dockerDir = join(ROOT, "docker");
if (existsSync(dockerDir))
  for (const f of readdirSync(dockerDir).sort()) if (f.endsWith("Dockerfile")) checkDockerfile(join(dockerDir, f));
if (!existsSync(join(ROOT, ".dockerignore"))) fail(".dockerignore", "missing");
rmSync(tmp, { recursive: true, force: true });

console.log(`validate-deploy: ${documents} documents in ${files.length} files:`);
for (const [k, n] of [...kinds].sort()) console.log(`  ${n} × ${k}`);
console.log(`validate-deploy: ${bootstraps} Envoy bootstraps from EnvoyFilter patches checked with ${ENVOY} --mode validate`);
console.log(`validate-deploy: ${dockerfiles} Dockerfiles checked`);
console.log(`validate-deploy: ${rendered} kustomizations rendered and validated strictly with ${KUBE_VALIDATE}; self-test: ${missed.length ? "FAILED" : "every planted error caught"}`);
if (failures.length) {
  console.error(`validate-deploy: ${failures.length} FAILED:`);
  for (const f of failures) console.error(`  ${f}`);
  process.exit(1);
}
console.log("validate-deploy: all OK");
