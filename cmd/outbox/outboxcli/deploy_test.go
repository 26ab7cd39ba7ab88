package outboxcli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"

	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
)

// The deploy files under docs/deploy name commands, flags, ports, probe
// paths and variables of the binary; these tests parse each file and hold
// those names to the binary, so a renamed flag or path breaks them.

const deployDir = "../../../docs/deploy/"

// checkArgs checks that args (without the program name) are a command of
// the binary with flags it takes, and returns the --http-listen value.
func checkArgs(t *testing.T, where string, args []string) (listen string) {
	t.Helper()
	if len(args) == 0 {
		t.Fatalf("%s: no command", where)
	}
	root := NewRoot(io.Discard, io.Discard)
	var cmd *cobra.Command
	for _, c := range root.Commands() {
		if c.Name() == args[0] {
			cmd = c
		}
	}
	if cmd == nil {
		t.Fatalf("%s: the binary has no command %q", where, args[0])
	}
	for i := 1; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") {
			t.Errorf("%s: %s takes no argument %q", where, cmd.Name(), a)
			continue
		}
		f := cmd.Flags().Lookup(name)
		if f == nil {
			f = cmd.InheritedFlags().Lookup(name)
		}
		if f == nil {
			t.Errorf("%s: `outbox %s` has no flag --%s", where, cmd.Name(), name)
			continue
		}
		if !hasValue && f.Value.Type() != "bool" {
			if i+1 >= len(args) {
				t.Errorf("%s: --%s needs a value", where, name)
				continue
			}
			i++
			value = args[i]
		}
		if err := f.Value.Set(value); err != nil && f.Value.Type() != "bool" {
			t.Errorf("%s: --%s %q: %v", where, name, value, err)
		}
		if name == "http-listen" {
			listen = value
		}
	}
	return listen
}

// servedPaths checks that each path answers on the relay's listener (the
// health endpoints, /metrics and, enabled, the console), not with 404.
func servedPaths(t *testing.T, where string, paths ...string) {
	t.Helper()
	mux := opsHandler(prometheus.NewRegistry(), func(context.Context) []core.Check { return nil }, discardLogger())
	con, err := console.New(console.Options{Admin: &admin.Admin{}, AnonymousReads: true})
	if err != nil {
		t.Fatal(err)
	}
	mountConsole(mux, con)
	for _, p := range paths {
		if h, pattern := mux.Handler(httptest.NewRequest(http.MethodGet, p, nil)); h == nil || pattern == "" {
			t.Errorf("%s: the relay serves no %s", where, p)
		}
	}
}

// checkEnv checks that an OUTBOX_ variable is a configuration key.
func checkEnv(t *testing.T, where, name string) {
	t.Helper()
	if !strings.HasPrefix(name, "OUTBOX_") {
		return
	}
	if key, ok := newEnvKeys(configKeys()).key(name); !ok || key == "" {
		t.Errorf("%s: %s is not a configuration variable", where, name)
	}
}

func port(t *testing.T, where, listen string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(listen)
	if err != nil {
		t.Fatalf("%s: --http-listen %q: %v", where, listen, err)
	}
	return p
}

func TestDockerfile(t *testing.T) {
	b, err := os.ReadFile(deployDir + "Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var froms, entry, cmd []string
	var user, expose string
	var build string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		instr, rest, _ := strings.Cut(line, " ")
		switch strings.ToUpper(instr) {
		case "FROM":
			froms = append(froms, rest)
		case "USER":
			user = rest
		case "EXPOSE":
			expose = rest
		case "RUN":
			if strings.Contains(rest, "go build") {
				build = rest
			}
		case "ENTRYPOINT", "CMD":
			var v []string
			if err := json.Unmarshal([]byte(rest), &v); err != nil {
				t.Fatalf("%s %s: use the JSON form: %v", instr, rest, err)
			}
			if instr == "CMD" {
				cmd = v
			} else {
				entry = v
			}
		}
	}
	if len(froms) < 2 {
		t.Errorf("not multi-stage: %v", froms)
	}
	if final := froms[len(froms)-1]; !strings.HasPrefix(final, "gcr.io/distroless/static") && final != "scratch" {
		t.Errorf("final image %q is neither distroless static nor scratch", final)
	}
	if u, _, _ := strings.Cut(user, ":"); u == "" || u == "0" || u == "root" {
		t.Errorf("USER %q: the image must not run as root", user)
	}
	if !strings.Contains(build, "CGO_ENABLED=0") || !strings.HasSuffix(build, "./cmd/outbox") {
		t.Errorf("build %q is not a static build of ./cmd/outbox", build)
	}
	if !strings.Contains(build, "-X github.com/outboxhq/outbox/cmd/outbox/outboxcli.version=${VERSION}") {
		t.Errorf("build %q does not set the version `outbox version` reports", build)
	}
	if len(entry) != 1 || !strings.HasSuffix(entry[0], "/outbox") {
		t.Errorf("ENTRYPOINT %v is not the binary", entry)
	}
	listen := checkArgs(t, "Dockerfile CMD", cmd)
	if p := port(t, "Dockerfile", listen); p != expose {
		t.Errorf("EXPOSE %s, but the relay listens on %s", expose, p)
	}
}

// systemdUnit reads a unit file of docs/deploy as section.key -> values.
func systemdUnit(t *testing.T, name string) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(deployDir + name)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string][]string{}
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: line %q is not key=value", name, line)
			}
			keys[section+"."+k] = append(keys[section+"."+k], v)
		}
	}
	// Every command it runs is the binary's, with flags it takes.
	for _, k := range []string{"Service.ExecStart", "Service.ExecStartPre"} {
		for _, v := range keys[k] {
			f := strings.Fields(v)
			if !strings.HasSuffix(f[0], "/outbox") {
				t.Errorf("%s: %s runs %s, not the binary", name, k, f[0])
			}
			if listen := checkArgs(t, name+" "+k, f[1:]); listen != "" {
				servedPaths(t, name, "/metrics", "/healthz", "/readyz")
			}
		}
	}
	if u := keys["Service.User"]; len(u) > 0 && u[0] == "root" {
		t.Errorf("%s runs as root", name)
	}
	return keys
}

func TestSystemdUnit(t *testing.T) {
	keys := systemdUnit(t, "outbox.service")
	if len(keys["Service.ExecStart"]) != 1 || !strings.Contains(keys["Service.ExecStart"][0], " relay ") {
		t.Errorf("ExecStart %v is not one `outbox relay`", keys["Service.ExecStart"])
	}
	stop, err := time.ParseDuration(strings.Join(keys["Service.TimeoutStopSec"], ""))
	if err != nil || stop <= Defaults().Relay.ShutdownTimeout {
		t.Errorf("TimeoutStopSec %v (%v) does not exceed relay.shutdown_timeout %s", keys["Service.TimeoutStopSec"], err, Defaults().Relay.ShutdownTimeout)
	}
	if got := strings.Join(keys["Service.RestartPreventExitStatus"], ""); got != "2" || ExitUsage != 2 {
		t.Errorf("RestartPreventExitStatus %q, want the usage exit code %d", got, ExitUsage)
	}

	// The migrations run in a unit of their own, as the owner, with a
	// secrets file the relay does not read.
	mig := systemdUnit(t, "outbox-migrate.service")
	if pre := keys["Service.ExecStartPre"]; len(pre) > 0 {
		t.Errorf("the relay's unit runs %v before the relay: migrations belong to outbox-migrate.service", pre)
	}
	runs := strings.Join(mig["Service.ExecStart"], "\n")
	if !strings.Contains(runs, " migrate ") || !strings.Contains(runs, " grants --apply --relay-role ") {
		t.Errorf("outbox-migrate.service runs %q: want `outbox migrate` and `outbox grants --apply --relay-role ...`", runs)
	}
	if got := strings.Join(mig["Service.Type"], ""); got != "oneshot" {
		t.Errorf("outbox-migrate.service Type=%s, want oneshot", got)
	}
	relayEnv, migEnv := strings.Join(keys["Service.EnvironmentFile"], ","), strings.Join(mig["Service.EnvironmentFile"], ",")
	if relayEnv == "" || migEnv == "" || relayEnv == migEnv {
		t.Errorf("EnvironmentFile: relay %q, migrations %q; want a file each", relayEnv, migEnv)
	}
	for _, k := range []string{"Unit.Wants", "Unit.After"} {
		if !strings.Contains(strings.Join(keys[k], " "), "outbox-migrate.service") {
			t.Errorf("the relay's unit lacks %s=outbox-migrate.service", k)
		}
	}
}

// k8sDoc is the part of a manifest the test reads.
type k8sDoc struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Spec yaml.Node `yaml:"spec"`
}

type container struct {
	Name    string   `yaml:"name"`
	Image   string   `yaml:"image"`
	Args    []string `yaml:"args"`
	EnvFrom []struct {
		SecretRef struct {
			Name string `yaml:"name"`
		} `yaml:"secretRef"`
	} `yaml:"envFrom"`
	Ports []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	Env []struct {
		Name string `yaml:"name"`
	} `yaml:"env"`
	Readiness *probe `yaml:"readinessProbe"`
	Liveness  *probe `yaml:"livenessProbe"`
}

type probe struct {
	HTTPGet struct {
		Path string `yaml:"path"`
		Port any    `yaml:"port"`
	} `yaml:"httpGet"`
}

func TestKubernetesManifests(t *testing.T) {
	b, err := os.ReadFile(deployDir + "kubernetes.yaml")
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]k8sDoc{}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var d k8sDoc
		if err := dec.Decode(&d); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		docs[d.Kind] = d
	}
	for _, kind := range []string{"Job", "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"} {
		if _, ok := docs[kind]; !ok {
			t.Errorf("no %s", kind)
		}
	}
	var dep struct {
		Replicas int `yaml:"replicas"`
		Selector struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
		Template struct {
			Metadata struct {
				Labels map[string]string `yaml:"labels"`
			} `yaml:"metadata"`
			Spec struct {
				Grace          int         `yaml:"terminationGracePeriodSeconds"`
				InitContainers []container `yaml:"initContainers"`
				Containers     []container `yaml:"containers"`
				Security       struct {
					RunAsNonRoot bool `yaml:"runAsNonRoot"`
				} `yaml:"securityContext"`
			} `yaml:"spec"`
		} `yaml:"template"`
	}
	if err := specOf(docs["Deployment"]).Decode(&dep); err != nil {
		t.Fatal(err)
	}
	if dep.Replicas < 2 {
		t.Errorf("replicas %d: run more than one", dep.Replicas)
	}
	if !reflect.DeepEqual(dep.Selector.MatchLabels, dep.Template.Metadata.Labels) {
		t.Errorf("selector %v does not match the pods' labels %v", dep.Selector.MatchLabels, dep.Template.Metadata.Labels)
	}
	if !dep.Template.Spec.Security.RunAsNonRoot {
		t.Error("pods may run as root")
	}
	if g := time.Duration(dep.Template.Spec.Grace) * time.Second; g <= Defaults().Relay.ShutdownTimeout {
		t.Errorf("terminationGracePeriodSeconds %s does not exceed relay.shutdown_timeout", g)
	}
	if len(dep.Template.Spec.InitContainers) > 0 {
		t.Errorf("the relay's pods run init containers %+v: migrations belong to the Job, with the owner's Secret", dep.Template.Spec.InitContainers)
	}
	if len(dep.Template.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want the relay", len(dep.Template.Spec.Containers))
	}
	relay := dep.Template.Spec.Containers[0]
	checkMigrationJob(t, docs["Job"], relay, b)
	listen := checkArgs(t, "container "+relay.Name, relay.Args)
	if relay.Args[0] != "relay" || listen == "" {
		t.Fatalf("container args %v: want `relay --http-listen ...`", relay.Args)
	}
	lp := port(t, "container", listen)
	named := map[string]string{}
	for _, p := range relay.Ports {
		named[p.Name] = strconv.Itoa(p.ContainerPort)
	}
	for name, pr := range map[string]*probe{"readinessProbe": relay.Readiness, "livenessProbe": relay.Liveness} {
		if pr == nil {
			t.Errorf("no %s", name)
			continue
		}
		p := itoaAny(pr.HTTPGet.Port)
		if n, ok := named[p]; ok {
			p = n
		}
		if p != lp {
			t.Errorf("%s on port %s, the relay listens on %s", name, p, lp)
		}
		servedPaths(t, name, pr.HTTPGet.Path)
	}
	if relay.Readiness != nil && relay.Readiness.HTTPGet.Path != "/readyz" || relay.Liveness != nil && relay.Liveness.HTTPGet.Path != "/healthz" {
		t.Errorf("probes: readiness %s, liveness %s; want /readyz and /healthz (a restart does not fix an outage)",
			relay.Readiness.HTTPGet.Path, relay.Liveness.HTTPGet.Path)
	}
	for _, e := range relay.Env {
		checkEnv(t, "container env", e.Name)
	}

	var svc struct {
		Selector map[string]string `yaml:"selector"`
		Ports    []struct {
			Name       string `yaml:"name"`
			TargetPort any    `yaml:"targetPort"`
		} `yaml:"ports"`
	}
	if err := specOf(docs["Service"]).Decode(&svc); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(svc.Selector, dep.Selector.MatchLabels) {
		t.Errorf("Service selects %v, the pods are %v", svc.Selector, dep.Selector.MatchLabels)
	}
	svcPorts := map[string]bool{}
	for _, p := range svc.Ports {
		svcPorts[p.Name] = true
		if tp := itoaAny(p.TargetPort); named[tp] != lp && tp != lp {
			t.Errorf("Service port %s targets %s, not the relay's %s", p.Name, tp, lp)
		}
	}
	var pdb struct {
		MinAvailable int `yaml:"minAvailable"`
		Selector     struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
	}
	if err := specOf(docs["PodDisruptionBudget"]).Decode(&pdb); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(pdb.Selector.MatchLabels, dep.Selector.MatchLabels) || pdb.MinAvailable < 1 || pdb.MinAvailable >= dep.Replicas {
		t.Errorf("PodDisruptionBudget %+v does not keep one of %d replicas up while allowing a drain", pdb, dep.Replicas)
	}
	var sm struct {
		JobLabel  string `yaml:"jobLabel"`
		Endpoints []struct {
			Port string `yaml:"port"`
			Path string `yaml:"path"`
		} `yaml:"endpoints"`
	}
	if err := specOf(docs["ServiceMonitor"]).Decode(&sm); err != nil {
		t.Fatal(err)
	}
	for _, ep := range sm.Endpoints {
		if !svcPorts[ep.Port] {
			t.Errorf("ServiceMonitor scrapes port %q, which the Service lacks", ep.Port)
		}
		servedPaths(t, "ServiceMonitor", ep.Path)
	}
	// The alerts select job="outbox-relay": the job label must be that.
	if got := docs["Service"].Metadata.Labels[sm.JobLabel]; got != "outbox-relay" {
		t.Errorf("the scrape job is named %q, the alerts expect outbox-relay", got)
	}

	// The PrometheusRule carries the shipped rules, unchanged.
	var rule, shipped struct {
		Groups any `yaml:"groups"`
	}
	if err := specOf(docs["PrometheusRule"]).Decode(&rule); err != nil {
		t.Fatal(err)
	}
	rb, err := os.ReadFile("../../../docs/alerts/outbox-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(rb, &shipped); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rule.Groups, shipped.Groups) {
		t.Error("the PrometheusRule's groups differ from docs/alerts/outbox-rules.yml")
	}
}

// checkMigrationJob checks that the Job migrates and grants the relay's
// role with a Secret of its own, on the relay's image, and that the
// manifest's header says how to build that image and create both Secrets.
func checkMigrationJob(t *testing.T, job k8sDoc, relay container, manifest []byte) {
	t.Helper()
	var spec struct {
		Template struct {
			Spec struct {
				RestartPolicy  string      `yaml:"restartPolicy"`
				InitContainers []container `yaml:"initContainers"`
				Containers     []container `yaml:"containers"`
			} `yaml:"spec"`
		} `yaml:"template"`
	}
	if err := specOf(job).Decode(&spec); err != nil {
		t.Fatal(err)
	}
	if len(spec.Template.Spec.Containers) == 0 {
		t.Fatal("the Job runs no container")
	}
	secretOf := func(c container) string {
		if len(c.EnvFrom) != 1 {
			t.Errorf("container %s: envFrom %+v, want one Secret", c.Name, c.EnvFrom)
			return ""
		}
		return c.EnvFrom[0].SecretRef.Name
	}
	relaySecret := secretOf(relay)
	var cmds []string
	for _, c := range append(spec.Template.Spec.InitContainers, spec.Template.Spec.Containers...) {
		checkArgs(t, "Job container "+c.Name, c.Args)
		cmds = append(cmds, strings.Join(c.Args, " "))
		if s := secretOf(c); s == relaySecret {
			t.Errorf("Job container %s uses the relay's Secret %q: migrations run as the owner", c.Name, s)
		}
		if c.Image != relay.Image {
			t.Errorf("Job container %s runs image %q, the relay %q", c.Name, c.Image, relay.Image)
		}
	}
	if len(cmds) != 2 || cmds[0] != "migrate" || !strings.HasPrefix(cmds[1], "grants --apply --relay-role ") {
		t.Errorf("the Job runs %q: want migrate, then grants --apply --relay-role ...", cmds)
	}
	if p := spec.Template.Spec.RestartPolicy; p != "OnFailure" && p != "Never" {
		t.Errorf("the Job's restartPolicy %q", p)
	}
	image, _, _ := strings.Cut(relay.Image, ":")
	for _, want := range []string{"docker build -f docs/deploy/Dockerfile", "-t " + relay.Image, "docker push " + relay.Image,
		"kubectl create secret generic " + relaySecret, "kubectl create secret generic " + secretOf(spec.Template.Spec.Containers[0])} {
		if !bytes.Contains(manifest, []byte(want)) {
			t.Errorf("the manifest's header does not say %q (image %s)", want, image)
		}
	}
}

func specOf(d k8sDoc) *yaml.Node { return &d.Spec }

// itoaAny renders a port given as a number or a name.
func itoaAny(v any) string {
	switch v := v.(type) {
	case int:
		return strconv.Itoa(v)
	case string:
		return v
	}
	return ""
}

// docs/security.md shows what `outbox grants` prints for its example.
func TestSecurityDocGrantsSample(t *testing.T) {
	b, err := os.ReadFile("../../../docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	const cmd = "outbox grants --schema shop --relay-role outbox_relay --producer-role shop_app"
	doc := string(b)
	i := strings.Index(doc, cmd)
	if i < 0 {
		t.Fatalf("docs/security.md lacks %q", cmd)
	}
	_, rest, _ := strings.Cut(doc[i:], "```sql\n")
	sample, _, _ := strings.Cut(rest, "```")
	var out bytes.Buffer
	root := NewRoot(&out, io.Discard)
	root.SetArgs(strings.Fields(cmd)[1:])
	if err := root.ExecuteContext(context.Background()); err != nil {
		t.Fatal(err)
	}
	if sample != out.String() {
		t.Errorf("docs/security.md shows\n%s\n`%s` prints\n%s", sample, cmd, out.String())
	}
}

// TestAlertsHaveRunbooks checks that every shipped alert's runbook names a
// heading of docs/operations.md, and that the slot alerts read gauges the
// log relay serves.
func TestAlertsHaveRunbooks(t *testing.T) {
	rb, err := os.ReadFile("../../../docs/alerts/outbox-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(rb, &rules); err != nil {
		t.Fatal(err)
	}
	ops, err := os.ReadFile("../../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(ops), "\n") {
		if h, ok := strings.CutPrefix(line, "### "); ok {
			anchors[strings.ToLower(strings.ReplaceAll(strings.TrimSpace(h), " ", "-"))] = true
		}
	}
	reg := prometheus.NewRegistry()
	newSlotMetrics(reg)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	for _, f := range families {
		served[f.GetName()] = true
	}
	slotMetric := regexp.MustCompile(`outbox_slot_[a-z_]+`)
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			_, anchor, ok := strings.Cut(r.Annotations["runbook"], "docs/operations.md#")
			if !ok || !anchors[anchor] {
				t.Errorf("alert %s: runbook %q names no heading of docs/operations.md", r.Alert, r.Annotations["runbook"])
			}
			for _, m := range slotMetric.FindAllString(r.Expr, -1) {
				if !served[m] {
					t.Errorf("alert %s reads %s, which the log relay does not serve", r.Alert, m)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no alerts read from docs/alerts/outbox-rules.yml")
	}
}
