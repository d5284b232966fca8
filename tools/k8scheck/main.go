// Command k8scheck validates Kubernetes manifests offline: no cluster, no API server, no network.
//
// Usage: k8scheck [-external-secret NAME]... [-probe-path /p]... [-known-env NAME]... DIR|FILE...
//
// Every document of every *.yaml / *.yml file is decoded STRICTLY against the Go types of the
// Kubernetes API (k8s.io/api): an unknown or misspelt field, a duplicated field or a value of the
// wrong type is an error, as `kubectl apply --validate=strict` would make it on a real cluster. A
// kustomization.yaml is decoded strictly into the subset of kustomize's fields Pygmy uses.
//
// Then it checks what a schema cannot, across documents (see checks below): a StatefulSet's
// governing Service exists and is headless, selectors match pod labels, probes name ports and
// paths that exist, PodDisruptionBudgets select a workload, Secrets referenced exist, every
// container requests resources, and Pygmy's own wiring (peer URLs in replica order, an id per pod).
//
// It prints one line per problem, "file:line: Kind/name: message", and exits 1 if there was any;
// else it prints a one-line summary and exits 0. Exit 2: bad usage or unreadable input.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

// doc is one decoded YAML document and where it came from.
type doc struct {
	file string
	line int
	kind string
	name string
	obj  runtime.Object
}

func (d *doc) where() string {
	if d.name == "" {
		return fmt.Sprintf("%s:%d: %s", d.file, d.line, d.kind)
	}
	return fmt.Sprintf("%s:%d: %s/%s", d.file, d.line, d.kind, d.name)
}

// workload is what StatefulSets and Deployments have in common for the checks.
type workload struct {
	d        *doc
	replicas int32
	selector *metav1.LabelSelector
	template *corev1.PodTemplateSpec
	claims   map[string]bool // volumeClaimTemplates (StatefulSet only)
}

// kustomization is the subset of kustomize's Kustomization that these manifests use; decoded
// strictly, so a field outside it is reported rather than silently ignored.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace,omitempty"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
		Digest  string `json:"digest,omitempty"`
	} `json:"images,omitempty"`
}

type checker struct {
	externalSecrets map[string]bool
	probePaths      map[string]bool
	knownEnv        map[string]bool // PYGMY_* variables Pygmy reads (empty: not checked)
	problems        []string
	docs            []*doc
	kustomizations  []*doc
	kust            map[*doc]*kustomization
	files           []string
}

func (c *checker) fail(d *doc, format string, args ...any) {
	c.problems = append(c.problems, d.where()+": "+fmt.Sprintf(format, args...))
}

func (c *checker) failFile(file string, line int, format string, args ...any) {
	c.problems = append(c.problems, fmt.Sprintf("%s:%d: %s", file, line, fmt.Sprintf(format, args...)))
}

// scheme knows the API groups a deployment of Pygmy uses or may soon (an Ingress or NetworkPolicy for
// the reverse proxy, an autoscaler for the frontends); a kind outside them is an error, not skipped.
var scheme = runtime.NewScheme()

func init() {
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme,
		networkingv1.AddToScheme, autoscalingv2.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
}

// split cuts a YAML stream into documents, each with the line it starts on; documents holding
// only comments or blanks are dropped.
func split(text []byte) (docs [][]byte, lines []int) {
	var cur [][]byte
	start := 1
	flush := func() {
		body := bytes.Join(cur, []byte("\n"))
		for i, l := range cur { // where it starts: its first line that is not a comment
			if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
				docs = append(docs, body)
				lines = append(lines, start+i)
				break
			}
		}
		cur = nil
	}
	for i, l := range bytes.Split(text, []byte("\n")) {
		if bytes.HasPrefix(l, []byte("---")) && (len(l) == 3 || l[3] == ' ' || l[3] == '\t' || l[3] == '\r') {
			flush()
			start = i + 2
			continue
		}
		cur = append(cur, l)
	}
	flush()
	return docs, lines
}

func (c *checker) load(file string) error {
	text, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	c.files = append(c.files, file)
	strict := serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
	bodies, lines := split(text)
	for i, body := range bodies {
		var tm metav1.TypeMeta
		var meta struct {
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(body, &tm); err != nil {
			c.failFile(file, lines[i], "not a YAML object: %v", err)
			continue
		}
		_ = yaml.Unmarshal(body, &meta)
		d := &doc{file: file, line: lines[i], kind: tm.Kind, name: meta.Metadata.Name}
		if tm.Kind == "Kustomization" {
			var k kustomization
			if err := yaml.UnmarshalStrict(body, &k); err != nil {
				c.fail(d, "strict decoding: %v", err)
				continue
			}
			if k.APIVersion != "kustomize.config.k8s.io/v1beta1" {
				c.fail(d, "apiVersion %q: expected kustomize.config.k8s.io/v1beta1", k.APIVersion)
			}
			c.kustomizations = append(c.kustomizations, d)
			c.kust[d] = &k
			continue
		}
		if tm.Kind == "" || tm.APIVersion == "" {
			c.fail(d, "apiVersion and kind are required")
			continue
		}
		obj, gvk, err := strict.Decode(body, nil, nil)
		if err != nil {
			// A strict error comes with the object decoded anyway; report it and drop the object,
			// so that nothing below reasons about a manifest the API server would refuse.
			c.fail(d, "strict decoding: %v", err)
			continue
		}
		d.obj, d.kind = obj, gvk.Kind
		if d.name == "" {
			c.fail(d, "metadata.name is required")
			continue
		}
		for _, msg := range validation.IsDNS1123Subdomain(d.name) {
			c.fail(d, "metadata.name: %s", msg)
		}
		c.docs = append(c.docs, d)
	}
	return nil
}

// --- helpers ---------------------------------------------------------------------------------

func selects(sel *metav1.LabelSelector, podLabels map[string]string) (bool, error) {
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return false, err
	}
	if s.Empty() {
		return false, nil // an empty selector would select every pod of the namespace: never what we mean
	}
	return s.Matches(labels.Set(podLabels)), nil
}

func (c *checker) workloads() []*workload {
	var out []*workload
	for _, d := range c.docs {
		switch o := d.obj.(type) {
		case *appsv1.StatefulSet:
			w := &workload{d: d, replicas: 1, selector: o.Spec.Selector, template: &o.Spec.Template, claims: map[string]bool{}}
			if o.Spec.Replicas != nil {
				w.replicas = *o.Spec.Replicas
			}
			for _, t := range o.Spec.VolumeClaimTemplates {
				w.claims[t.Name] = true
			}
			out = append(out, w)
		case *appsv1.Deployment:
			w := &workload{d: d, replicas: 1, selector: o.Spec.Selector, template: &o.Spec.Template}
			if o.Spec.Replicas != nil {
				w.replicas = *o.Spec.Replicas
			}
			out = append(out, w)
		}
	}
	return out
}

func (c *checker) find(kind, name string) *doc {
	for _, d := range c.docs {
		if d.kind == kind && d.name == name {
			return d
		}
	}
	return nil
}

// containerPort resolves a port given by number or name against one container's ports.
func containerPort(ctr *corev1.Container, port intstr.IntOrString) (int32, bool) {
	for _, p := range ctr.Ports {
		if (port.Type == intstr.String && p.Name == port.StrVal) || (port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

func allContainers(spec *corev1.PodSpec) []*corev1.Container {
	var out []*corev1.Container
	for i := range spec.InitContainers {
		out = append(out, &spec.InitContainers[i])
	}
	for i := range spec.Containers {
		out = append(out, &spec.Containers[i])
	}
	return out
}

func (c *checker) secretKeys(name string) (map[string]bool, bool) {
	d := c.find("Secret", name)
	if d == nil {
		return nil, false
	}
	s := d.obj.(*corev1.Secret)
	keys := map[string]bool{}
	for k := range s.Data {
		keys[k] = true
	}
	for k := range s.StringData {
		keys[k] = true
	}
	return keys, true
}

func portsString(ctr *corev1.Container) string {
	var ps []string
	for _, p := range ctr.Ports {
		ps = append(ps, fmt.Sprintf("%s=%d", p.Name, p.ContainerPort))
	}
	if len(ps) == 0 {
		return "none"
	}
	return strings.Join(ps, ", ")
}

// --- checks ----------------------------------------------------------------------------------

func (c *checker) checkDuplicates() {
	seen := map[string]*doc{}
	for _, d := range c.docs {
		key := d.kind + "/" + d.name
		if first, ok := seen[key]; ok {
			c.fail(d, "defined twice (first at %s:%d)", first.file, first.line)
		}
		seen[key] = d
	}
}

func (c *checker) checkWorkload(w *workload) {
	d, t := w.d, w.template
	if w.selector == nil {
		c.fail(d, "spec.selector is required")
	} else if ok, err := selects(w.selector, t.Labels); err != nil {
		c.fail(d, "spec.selector: %v", err)
	} else if !ok {
		c.fail(d, "spec.selector %s does not match the pod template's labels %v",
			metav1.FormatLabelSelector(w.selector), t.Labels)
	}
	spec := &t.Spec
	if len(spec.Containers) == 0 {
		c.fail(d, "the pod template has no containers")
	}
	volumes := map[string]bool{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = true
		if v.Secret != nil && (v.Secret.Optional == nil || !*v.Secret.Optional) {
			if _, ok := c.secretKeys(v.Secret.SecretName); !ok && !c.externalSecrets[v.Secret.SecretName] {
				c.fail(d, "volume %q: Secret %q is in none of the files (nor -external-secret), and not optional",
					v.Name, v.Secret.SecretName)
			}
		}
	}
	nonRoot := spec.SecurityContext != nil && spec.SecurityContext.RunAsNonRoot != nil && *spec.SecurityContext.RunAsNonRoot
	for _, ctr := range allContainers(spec) {
		where := fmt.Sprintf("container %q", ctr.Name)
		if ctr.Image == "" {
			c.fail(d, "%s: no image", where)
		}
		c.checkResources(d, where, ctr)
		c.checkProbes(d, where, ctr)
		c.checkEnv(d, where, ctr)
		for _, m := range ctr.VolumeMounts {
			if !volumes[m.Name] && !w.claims[m.Name] {
				c.fail(d, "%s: volumeMount %q names no volume of the pod nor a volumeClaimTemplate", where, m.Name)
			}
		}
		sc := ctr.SecurityContext
		if !nonRoot && (sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot) {
			c.fail(d, "%s: runAsNonRoot is not set (pod or container securityContext)", where)
		}
	}
	if a := spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		for i, term := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			if ok, _ := selects(term.PodAffinityTerm.LabelSelector, t.Labels); !ok {
				c.fail(d, "podAntiAffinity preferred term %d: its labelSelector does not select this workload's own pods", i)
			}
		}
		for i, term := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
			if ok, _ := selects(term.LabelSelector, t.Labels); !ok {
				c.fail(d, "podAntiAffinity required term %d: its labelSelector does not select this workload's own pods", i)
			}
		}
	}
}

func (c *checker) checkResources(d *doc, where string, ctr *corev1.Container) {
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, ok := ctr.Resources.Requests[r]
		if !ok {
			c.fail(d, "%s: no resources.requests.%s", where, r)
			continue
		}
		if lim, ok := ctr.Resources.Limits[r]; ok && lim.Cmp(req) < 0 {
			c.fail(d, "%s: resources.limits.%s %s is below its request %s", where, r, lim.String(), req.String())
		}
	}
}

func (c *checker) checkProbes(d *doc, where string, ctr *corev1.Container) {
	probes := []struct {
		name  string
		probe *corev1.Probe
	}{{"startupProbe", ctr.StartupProbe}, {"readinessProbe", ctr.ReadinessProbe}, {"livenessProbe", ctr.LivenessProbe}}
	for _, p := range probes {
		if p.probe == nil {
			continue
		}
		h := p.probe.ProbeHandler
		switch {
		case h.HTTPGet != nil:
			if _, ok := containerPort(ctr, h.HTTPGet.Port); !ok {
				c.fail(d, "%s: %s port %s is not a port of the container (it has %s)", where, p.name,
					h.HTTPGet.Port.String(), portsString(ctr))
			}
			if len(c.probePaths) > 0 && !c.probePaths[h.HTTPGet.Path] {
				c.fail(d, "%s: %s path %q is not one the services answer (%s)", where, p.name, h.HTTPGet.Path,
					strings.Join(sortedKeys(c.probePaths), ", "))
			}
		case h.TCPSocket != nil:
			if _, ok := containerPort(ctr, h.TCPSocket.Port); !ok {
				c.fail(d, "%s: %s port %s is not a port of the container (it has %s)", where, p.name,
					h.TCPSocket.Port.String(), portsString(ctr))
			}
		}
	}
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

func (c *checker) checkEnv(d *doc, where string, ctr *corev1.Container) {
	defined := map[string]bool{}
	for _, e := range ctr.Env {
		if defined[e.Name] {
			c.fail(d, "%s: env %s is set twice", where, e.Name)
		}
		// $(VAR) expands only to a variable defined earlier in the list; otherwise it stays literal.
		for _, m := range varRef.FindAllStringSubmatch(e.Value, -1) {
			if !defined[m[1]] {
				c.fail(d, "%s: env %s refers to $(%s), which is not defined before it", where, e.Name, m[1])
			}
		}
		defined[e.Name] = true
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			ref := e.ValueFrom.SecretKeyRef
			optional := ref.Optional != nil && *ref.Optional
			keys, ok := c.secretKeys(ref.Name)
			switch {
			case ok && !keys[ref.Key] && !optional:
				c.fail(d, "%s: env %s: Secret %q has no key %q", where, e.Name, ref.Name, ref.Key)
			case !ok && !c.externalSecrets[ref.Name] && !optional:
				c.fail(d, "%s: env %s: Secret %q is in none of the files (nor -external-secret)", where, e.Name, ref.Name)
			}
		}
		if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil {
			ref := e.ValueFrom.ConfigMapKeyRef
			if c.find("ConfigMap", ref.Name) == nil && (ref.Optional == nil || !*ref.Optional) {
				c.fail(d, "%s: env %s: ConfigMap %q is in none of the files", where, e.Name, ref.Name)
			}
		}
		// Pygmy ignores a PYGMY_* variable it does not know: a misspelt setting would silently not apply.
		if len(c.knownEnv) > 0 && strings.HasPrefix(e.Name, "PYGMY_") && !c.knownEnv[e.Name] {
			c.fail(d, "%s: env %s is not a setting Pygmy reads (misspelt?), so it would be ignored", where, e.Name)
		}
		// Credentials come from a Secret, never as text in a manifest.
		if (e.Name == "PYGMY_SECRET" || e.Name == "PYGMY_ADMIN_TOKEN") && e.ValueFrom == nil {
			c.fail(d, "%s: env %s is given as plain text: take it from a Secret (secretKeyRef)", where, e.Name)
		}
	}
	for _, from := range ctr.EnvFrom {
		if ref := from.SecretRef; ref != nil && (ref.Optional == nil || !*ref.Optional) {
			if _, ok := c.secretKeys(ref.Name); !ok && !c.externalSecrets[ref.Name] {
				c.fail(d, "%s: envFrom: Secret %q is in none of the files (nor -external-secret)", where, ref.Name)
			}
		}
	}
}

func (c *checker) checkStatefulSet(d *doc, s *appsv1.StatefulSet) {
	if s.Spec.ServiceName == "" {
		c.fail(d, "spec.serviceName is empty: a StatefulSet's pods get stable DNS names only from a headless Service")
		return
	}
	sd := c.find("Service", s.Spec.ServiceName)
	if sd == nil {
		c.fail(d, "spec.serviceName %q: no Service of that name in the files (the headless Service that gives "+
			"its pods stable DNS names)", s.Spec.ServiceName)
		return
	}
	svc := sd.obj.(*corev1.Service)
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		c.fail(d, "spec.serviceName %q: that Service is not headless (clusterIP: None)", s.Spec.ServiceName)
	}
	if ok, _ := selects(&metav1.LabelSelector{MatchLabels: svc.Spec.Selector}, s.Spec.Template.Labels); !ok {
		c.fail(d, "spec.serviceName %q: that Service's selector %v does not select this StatefulSet's pods %v",
			s.Spec.ServiceName, svc.Spec.Selector, s.Spec.Template.Labels)
	}
	if !svc.Spec.PublishNotReadyAddresses {
		c.fail(d, "spec.serviceName %q: publishNotReadyAddresses is not true, so replicas cannot resolve each "+
			"other before they are ready (and none is ready before they elect a leader)", s.Spec.ServiceName)
	}
	for _, t := range s.Spec.VolumeClaimTemplates {
		if _, ok := t.Spec.Resources.Requests[corev1.ResourceStorage]; !ok {
			c.fail(d, "volumeClaimTemplate %q: no resources.requests.storage", t.Name)
		}
	}
}

func (c *checker) checkService(d *doc, svc *corev1.Service, ws []*workload) {
	if len(svc.Spec.Selector) == 0 {
		c.fail(d, "spec.selector is empty: it would select no pods (or, in an Endpoints-less setup, nothing to check)")
		return
	}
	matched := 0
	for _, w := range ws {
		if ok, _ := selects(&metav1.LabelSelector{MatchLabels: svc.Spec.Selector}, w.template.Labels); !ok {
			continue
		}
		matched++
		for _, p := range svc.Spec.Ports {
			target := p.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(p.Port)
			}
			found := false
			for i := range w.template.Spec.Containers {
				if _, ok := containerPort(&w.template.Spec.Containers[i], target); ok {
					found = true
				}
			}
			if !found {
				c.fail(d, "port %q: targetPort %s is not a port of %s/%s's containers", p.Name, target.String(),
					w.d.kind, w.d.name)
			}
		}
	}
	if matched == 0 {
		c.fail(d, "spec.selector %v selects the pods of no workload in the files", svc.Spec.Selector)
	}
}

func (c *checker) checkPDB(d *doc, pdb *policyv1.PodDisruptionBudget, ws []*workload) {
	if (pdb.Spec.MinAvailable == nil) == (pdb.Spec.MaxUnavailable == nil) {
		c.fail(d, "exactly one of minAvailable and maxUnavailable must be set")
	}
	if pdb.Spec.Selector == nil {
		c.fail(d, "spec.selector is required")
		return
	}
	var matched []*workload
	for _, w := range ws {
		if ok, err := selects(pdb.Spec.Selector, w.template.Labels); err != nil {
			c.fail(d, "spec.selector: %v", err)
			return
		} else if ok {
			matched = append(matched, w)
		}
	}
	if len(matched) == 0 {
		c.fail(d, "spec.selector %s selects the pods of no workload in the files", metav1.FormatLabelSelector(pdb.Spec.Selector))
		return
	}
	if len(matched) > 1 {
		c.fail(d, "spec.selector selects the pods of %d workloads: a budget should cover one tier", len(matched))
	}
	replicas := matched[0].replicas
	if m := pdb.Spec.MinAvailable; m != nil && m.Type == intstr.Int && m.IntVal >= replicas {
		c.fail(d, "minAvailable %d with %d replicas: no pod could ever be evicted (a node drain would hang)", m.IntVal, replicas)
	}
	if m := pdb.Spec.MaxUnavailable; m != nil && m.Type == intstr.Int && m.IntVal < 1 {
		c.fail(d, "maxUnavailable %d: no pod could ever be evicted (a node drain would hang)", m.IntVal)
	}
}

// checkSecret: Pygmy's credentials are never in a file of the repository; a Secret here is an
// example whose values must stay empty (a service refuses to start without them).
func (c *checker) checkSecret(d *doc, s *corev1.Secret) {
	for _, key := range []string{"PYGMY_SECRET", "PYGMY_ADMIN_TOKEN"} {
		if len(s.Data[key]) > 0 || s.StringData[key] != "" {
			c.fail(d, "%s has a value: a secret written in a manifest is known to everyone who reads it; "+
				"leave it empty here and create the Secret with values of your own", key)
		}
	}
}

// checkPygmy checks the wiring Pygmy itself expects (pygmy/kit/config.py): PYGMY_<TIER>_URLS lists
// the tier's replicas by position (the first is replica 1), each at its StatefulSet pod's stable
// DNS name; a StatefulSet's pods take their id from their ordinal, not one fixed --id for all; a
// frontend Deployment of several pods advertises each pod's own address for the cache pushes.
func (c *checker) checkPygmy(ws []*workload) {
	for _, w := range ws {
		for _, ctr := range allContainers(&w.template.Spec) {
			where := fmt.Sprintf("container %q", ctr.Name)
			argv := append(append([]string{}, ctr.Command...), ctr.Args...)
			if len(argv) > 0 && filepath.Base(argv[0]) == "pygmy" {
				argv = argv[1:]
			}
			serves := len(argv) >= 2 && argv[0] == "serve"
			if serves && w.d.kind == "StatefulSet" {
				if !contains(argv, "--id-from-hostname") {
					c.fail(w.d, "%s: a replica StatefulSet must run `pygmy serve %s --id-from-hostname` (pod N is "+
						"replica N+1); a fixed --id would give every pod the same name", where, argv[1])
				}
				if argv[1] != w.d.name {
					c.fail(w.d, "%s: serves tier %q, but the StatefulSet is named %q: PYGMY_<TIER>_URLS name the pods "+
						"of the StatefulSet named after the tier", where, argv[1], w.d.name)
				}
			}
			if serves && w.d.kind == "Deployment" && w.replicas > 1 {
				ok := false
				for _, e := range ctr.Env {
					if e.Name == "PYGMY_ADVERTISE_HOST" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil &&
						e.ValueFrom.FieldRef.FieldPath == "status.podIP" {
						ok = true
					}
				}
				if !ok {
					c.fail(w.d, "%s: %d pods share one advertised host: set PYGMY_ADVERTISE_HOST from the downward "+
						"API (fieldRef status.podIP), so that the catalog pushes to each pod's own cache", where, w.replicas)
				}
			}
			for _, e := range ctr.Env {
				for _, tier := range []string{"catalog", "order"} {
					if e.Name == "PYGMY_"+strings.ToUpper(tier)+"_URLS" {
						c.checkTierURLs(w.d, where, e.Name, e.Value, tier)
					}
				}
			}
		}
	}
}

func (c *checker) checkTierURLs(d *doc, where, env, value, tier string) {
	sd := c.find("StatefulSet", tier)
	if sd == nil {
		c.fail(d, "%s: env %s: no StatefulSet %q in the files", where, env, tier)
		return
	}
	s := sd.obj.(*appsv1.StatefulSet)
	replicas := int32(1)
	if s.Spec.Replicas != nil {
		replicas = *s.Spec.Replicas
	}
	port := int32(0)
	for _, ctr := range s.Spec.Template.Spec.Containers {
		if p, ok := containerPort(&ctr, intstr.FromString("http")); ok {
			port = p
		}
	}
	var urls []string
	for _, u := range strings.Split(value, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, strings.TrimRight(u, "/"))
		}
	}
	if int32(len(urls)) != replicas {
		c.fail(d, "%s: env %s lists %d URLs, but StatefulSet %s has %d replicas", where, env, len(urls), tier, replicas)
	}
	for i, u := range urls {
		want := fmt.Sprintf("http://%s-%d.%s:%s", tier, i, s.Spec.ServiceName, strconv.Itoa(int(port)))
		if u != want {
			c.fail(d, "%s: env %s: URL %d is %q; Pygmy's %s-%d is pod %s-%d, so expected %q", where, env, i+1, u,
				tier, i+1, tier, i, want)
		}
	}
}

// checkKustomizations: every resource listed exists, every manifest in the same directory is
// listed (a file left out is never applied), and example files are not (they hold placeholders).
func (c *checker) checkKustomizations() {
	for _, kd := range c.kustomizations {
		k := c.kust[kd]
		dir := filepath.Dir(kd.file)
		listed := map[string]bool{}
		for _, r := range k.Resources {
			p := filepath.Join(dir, r)
			listed[filepath.Clean(p)] = true
			if _, err := os.Stat(p); err != nil {
				c.fail(kd, "resources: %q does not exist", r)
			}
			if strings.Contains(filepath.Base(r), ".example.") {
				c.fail(kd, "resources: %q is an example with placeholders; it must not be applied", r)
			}
		}
		for _, f := range c.files {
			if filepath.Dir(f) != dir || f == kd.file || strings.Contains(filepath.Base(f), ".example.") {
				continue
			}
			if !listed[filepath.Clean(f)] {
				c.fail(kd, "resources: %q is not listed, so `kubectl apply -k` would leave it out", filepath.Base(f))
			}
		}
		images := map[string]bool{}
		for _, w := range c.workloads() {
			for _, ctr := range allContainers(&w.template.Spec) {
				images[imageName(ctr.Image)] = true
			}
		}
		for _, img := range k.Images {
			if !images[img.Name] {
				c.fail(kd, "images: %q is the image of no container", img.Name)
			}
		}
	}
}

// imageName is an image reference without its tag or digest ("reg:5000/pygmy:1" -> "reg:5000/pygmy").
func imageName(ref string) string {
	ref = strings.SplitN(ref, "@", 2)[0]
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		return ref[:i]
	}
	return ref
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var external, paths, env listFlag
	flag.Var(&external, "external-secret", "a Secret created outside these files (repeatable)")
	flag.Var(&paths, "probe-path", "an HTTP path the services answer, allowed in probes (repeatable; none: any)")
	flag.Var(&env, "known-env", "a PYGMY_* variable Pygmy reads (repeatable; none: any)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: k8scheck [-external-secret NAME]... [-probe-path /p]... [-known-env NAME]... DIR|FILE...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	c := &checker{externalSecrets: map[string]bool{}, probePaths: map[string]bool{}, knownEnv: map[string]bool{},
		kust: map[*doc]*kustomization{}}
	for _, e := range env {
		c.knownEnv[e] = true
	}
	for _, s := range external {
		c.externalSecrets[s] = true
	}
	for _, p := range paths {
		c.probePaths[p] = true
	}
	var files []string
	for _, arg := range flag.Args() {
		info, err := os.Stat(arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8scheck:", err)
			os.Exit(2)
		}
		if !info.IsDir() {
			files = append(files, arg)
			continue
		}
		entries, err := os.ReadDir(arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8scheck:", err)
			os.Exit(2)
		}
		for _, e := range entries {
			if ext := filepath.Ext(e.Name()); !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
				files = append(files, filepath.Join(arg, e.Name()))
			}
		}
	}
	sort.Strings(files)
	if len(files) == 0 {
		fmt.Fprintln(os.Stderr, "k8scheck: no *.yaml files found")
		os.Exit(2)
	}
	for _, f := range files {
		if err := c.load(f); err != nil {
			fmt.Fprintln(os.Stderr, "k8scheck:", err)
			os.Exit(2)
		}
	}
	if len(c.problems) > 0 {
		// Checks across documents would report knock-on errors of a document left out: first the files
		// must decode.
		for _, p := range c.problems {
			fmt.Println(p)
		}
		fmt.Printf("k8scheck: %d problem(s) in %d file(s); checks across documents skipped until every "+
			"document decodes\n", len(c.problems), len(files))
		os.Exit(1)
	}
	c.checkDuplicates()
	ws := c.workloads()
	for _, w := range ws {
		c.checkWorkload(w)
	}
	for _, d := range c.docs {
		switch o := d.obj.(type) {
		case *appsv1.StatefulSet:
			c.checkStatefulSet(d, o)
		case *corev1.Service:
			c.checkService(d, o, ws)
		case *policyv1.PodDisruptionBudget:
			c.checkPDB(d, o, ws)
		case *corev1.Secret:
			c.checkSecret(d, o)
		}
	}
	c.checkPygmy(ws)
	c.checkKustomizations()
	for _, p := range c.problems {
		fmt.Println(p)
	}
	if len(c.problems) > 0 {
		fmt.Printf("k8scheck: %d problem(s) in %d file(s)\n", len(c.problems), len(files))
		os.Exit(1)
	}
	fmt.Printf("k8scheck: ok: %d documents in %d file(s)\n", len(c.docs)+len(c.kustomizations), len(files))
}
