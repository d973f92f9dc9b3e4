// Command argocd is the part of Argo CD the dev cluster runs, built from the upstream Go module: one
// binary that acts by the name it is called as (os.Args[0] or $ARGOCD_BINARY_NAME), as upstream's
// cmd/main.go does, but with only what a GitOps test needs, so it builds in a fraction of the time:
//
//	argocd-application-controller   upstream's application controller
//	argocd-repo-server              upstream's repo server (renders manifests from git)
//	argocd-git-ask-pass             the git credential helper the repo server calls
//	kustomize                       kustomize, the version Argo CD ships, for kustomize sources
//	argocd-redis --addr HOST:PORT   an in-process Redis (miniredis, which Argo CD itself uses in
//	                                `argocd --core`), so no Redis package has to be installed
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/alicebob/miniredis/v2"
	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
	kustomize "sigs.k8s.io/kustomize/kustomize/v5/commands"

	appcontroller "github.com/argoproj/argo-cd/v3/cmd/argocd-application-controller/commands"
	gitaskpass "github.com/argoproj/argo-cd/v3/cmd/argocd-git-ask-pass/commands"
	reposerver "github.com/argoproj/argo-cd/v3/cmd/argocd-repo-server/commands"
	"github.com/argoproj/argo-cd/v3/common"
	"github.com/argoproj/argo-cd/v3/util/log"
)

func runRedis(args []string) {
	fs := flag.NewFlagSet("argocd-redis", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:6379", "address to listen on")
	_ = fs.Parse(args)
	srv := miniredis.NewMiniRedis()
	if err := srv.StartAddr(*addr); err != nil {
		fmt.Fprintf(os.Stderr, "argocd-redis: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("argocd-redis: listening on %s\n", srv.Addr())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	srv.Close()
}

func main() {
	name := filepath.Base(os.Args[0])
	if v := os.Getenv("ARGOCD_BINARY_NAME"); v != "" {
		name = v
	}
	var command *cobra.Command
	switch name {
	case "kustomize":
		os.Exit(func() int {
			if err := kustomize.NewDefaultCommand().Execute(); err != nil {
				return 1
			}
			return 0
		}())
	case "argocd-redis":
		runRedis(os.Args[1:])
		return
	case common.CommandApplicationController:
		command = appcontroller.NewCommand()
	case common.CommandRepoServer:
		command = reposerver.NewCommand()
	case common.CommandGitAskPass:
		command = gitaskpass.NewCommand()
	default:
		fmt.Fprintf(os.Stderr, "%s: unknown command name; call as %s, %s, %s, kustomize or argocd-redis "+
			"(a link with that name, or $ARGOCD_BINARY_NAME)\n", name, common.CommandApplicationController,
			common.CommandRepoServer, common.CommandGitAskPass)
		os.Exit(2)
	}
	// What upstream's cmd/main.go does before running any component, except grpc.DisableSRVLookups:
	// that undoes what grpc's grpclb balancer turns on when it is linked (by packages of upstream's
	// CLI and API server), and panics when it is not, as in this binary, where SRV lookups stay off.
	klog.SetLogger(log.NewLogrusLogger(log.NewWithCurrentConfig()))
	if err := command.Execute(); err != nil {
		os.Exit(1)
	}
}
