// Command grafana-dashboard-check validates Grafana dashboard JSON files against Grafana's dashboard
// schema as Grafana publishes it in code (github.com/grafana/grafana-foundation-sdk, generated from the
// schemas in Grafana's repository): a strict decode (an unknown field anywhere, a wrong type, a panel
// option the panel plugin does not have, a query field the Prometheus datasource does not have is an
// error), every panel type a known core panel plugin, then the schema's own constraints (Validate).
//
// Usage: grafana-dashboard-check FILE... ; prints one line per problem, exits 1 if there was any.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

// failed tells a real error from the SDK's typed-nil one (an empty cog.BuildErrors in a non-nil error).
func failed(err error) bool {
	var errs cog.BuildErrors
	if errors.As(err, &errs) {
		return len(errs) > 0
	}
	return err != nil
}

func check(path string) []string {
	raw, err := os.ReadFile(path)
	if err != nil {
		return []string{err.Error()}
	}
	var problems []string
	var d dashboard.Dashboard
	if err := d.UnmarshalJSONStrict(raw); failed(err) {
		problems = append(problems, fmt.Sprintf("schema: %v", err))
	}
	var loose struct {
		Panels []struct {
			Type   string `json:"type"`
			Title  string `json:"title"`
			Panels []struct {
				Type  string `json:"type"`
				Title string `json:"title"`
			} `json:"panels"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &loose); err != nil {
		return append(problems, err.Error())
	}
	known := func(kind, title string) {
		if _, ok := cog.ConfigForPanelcfgVariant(kind); !ok && kind != "row" {
			problems = append(problems, fmt.Sprintf("panel %q: unknown panel type %q", title, kind))
		}
	}
	for _, p := range loose.Panels {
		known(p.Type, p.Title)
		for _, c := range p.Panels {
			known(c.Type, c.Title)
		}
	}
	if len(problems) == 0 {
		if err := d.Validate(); failed(err) {
			problems = append(problems, fmt.Sprintf("constraints: %v", err))
		}
	}
	return problems
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: grafana-dashboard-check FILE...")
		os.Exit(2)
	}
	plugins.RegisterDefaultPlugins()
	failed := false
	for _, path := range os.Args[1:] {
		problems := check(path)
		for _, p := range problems {
			fmt.Printf("%s: %s\n", path, p)
		}
		if len(problems) == 0 {
			fmt.Printf("%s: ok\n", path)
		} else {
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}
