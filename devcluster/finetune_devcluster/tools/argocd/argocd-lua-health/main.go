// Command argocd-lua-health evaluates resource health checks with Argo CD's own Lua engine
// (github.com/argoproj/argo-cd/v3/util/lua), the way Argo CD itself does, and prints one JSON object
// per result. Two modes:
//
//	argocd-lua-health cm ARGOCD_CM.yaml OBJECT.yaml...
//	    The checks exactly as the application-controller gets them: argocd-cm is read by Argo CD's
//	    settings manager (util/settings: resource.customizations.health.<group>_<kind>, useOpenLibs),
//	    then each object is evaluated by lua.ResourceHealthOverrides.GetResourceHealth -- with the
//	    standard Lua libraries closed unless argocd-cm opens them.
//	    Output: {"input": PATH, "status": ..., "message": ...} or {"input": PATH, "error": ...}.
//
//	argocd-lua-health builtin DIR
//	    DIR in the layout of Argo CD's resource_customizations/<group>/<kind>/{health.lua,
//	    health_test.yaml,testdata/}: every test of every health_test.yaml, run as upstream's
//	    util/lua/health_test.go runs them (VM{UseOpenLibs: true}.ExecuteHealthLua).
//	    Output: {"input": PATH, "expected": {...}, "status": ..., "message": ...} per test.
//
// Exit status 0 when every object was evaluated (whatever its health), 1 on any error.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/argoproj/argo-cd/gitops-engine/v3/pkg/health"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/argo-cd/v3/util/settings"
)

type result struct {
	Input    string                  `json:"input"`
	Expected *health.HealthStatus    `json:"expected,omitempty"`
	Status   health.HealthStatusCode `json:"status,omitempty"`
	Message  string                  `json:"message,omitempty"`
	Error    string                  `json:"error,omitempty"`
}

type testTable struct {
	Tests []struct {
		InputPath    string              `json:"inputPath"`
		HealthStatus health.HealthStatus `json:"healthStatus"`
	} `json:"tests"`
}

func readObject(path string) (*unstructured.Unstructured, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	obj := map[string]any{}
	if err := yaml.Unmarshal(data, &obj); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &unstructured.Unstructured{Object: obj}, nil
}

func emit(r result) bool {
	out, _ := json.Marshal(r)
	fmt.Println(string(out))
	return r.Error == ""
}

func fromResult(input string, hs *health.HealthStatus, err error) result {
	r := result{Input: input}
	switch {
	case err != nil:
		r.Error = err.Error()
	case hs == nil:
		r.Error = "no health check applies to this object"
	default:
		r.Status, r.Message = hs.Status, hs.Message
	}
	return r
}

func runConfigMap(cmPath string, objects []string) bool {
	data, err := os.ReadFile(cmPath)
	if err != nil {
		return emit(result{Input: cmPath, Error: err.Error()})
	}
	cm := &corev1.ConfigMap{}
	if err := yaml.Unmarshal(data, cm); err != nil {
		return emit(result{Input: cmPath, Error: err.Error()})
	}
	const ns = "argocd"
	cm.Namespace = ns
	mgr := settings.NewSettingsManager(context.Background(), fake.NewClientset(cm), ns)
	overrides, err := mgr.GetResourceOverrides()
	if err != nil {
		return emit(result{Input: cmPath, Error: fmt.Sprintf("argocd-cm: %v", err)})
	}
	ok := true
	for _, path := range objects {
		obj, err := readObject(path)
		if err != nil {
			ok = emit(result{Input: path, Error: err.Error()}) && ok
			continue
		}
		hs, err := lua.ResourceHealthOverrides(overrides).GetResourceHealth(obj)
		ok = emit(fromResult(path, hs, err)) && ok
	}
	return ok
}

func runBuiltin(root string) bool {
	ok := true
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "health.lua" {
			return err
		}
		dir := filepath.Dir(path)
		script, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		tableBytes, err := os.ReadFile(filepath.Join(dir, "health_test.yaml"))
		if err != nil {
			return err
		}
		var table testTable
		if err := yaml.Unmarshal(tableBytes, &table); err != nil {
			return fmt.Errorf("%s: %w", filepath.Join(dir, "health_test.yaml"), err)
		}
		for _, tc := range table.Tests {
			input := filepath.Join(dir, tc.InputPath)
			expected := tc.HealthStatus
			obj, err := readObject(input)
			if err != nil {
				ok = emit(result{Input: input, Expected: &expected, Error: err.Error()}) && ok
				continue
			}
			vm := lua.VM{UseOpenLibs: true}
			hs, err := vm.ExecuteHealthLua(obj, string(script))
			r := fromResult(input, hs, err)
			r.Expected = &expected
			ok = emit(r) && ok
		}
		return nil
	})
	if err != nil {
		return emit(result{Input: root, Error: err.Error()})
	}
	return ok
}

func main() {
	args := os.Args[1:]
	ok := false
	switch {
	case len(args) >= 2 && args[0] == "cm":
		ok = runConfigMap(args[1], args[2:])
	case len(args) == 2 && args[0] == "builtin":
		ok = runBuiltin(args[1])
	default:
		fmt.Fprintln(os.Stderr, "usage: argocd-lua-health cm ARGOCD_CM.yaml OBJECT.yaml... | builtin DIR")
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}
