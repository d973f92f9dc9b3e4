// fake-device-plugin: a kubelet device plugin (the real v1beta1 gRPC API) that advertises simulated
// accelerators, e.g. nvidia.com/gpu=4 and vpc.amazonaws.com/efa=1, so that GPU-shaped pods schedule onto
// a dev cluster's real (CPU-only) node. Allocate hands the container no device nodes, only environment
// variables naming the fake device IDs: the containers see no GPU or EFA device, and must not need one.
//
//	fake-device-plugin --dir /var/lib/kubelet/device-plugins --resource nvidia.com/gpu=4 --resource vpc.amazonaws.com/efa=1
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type resources []string

func (r *resources) String() string     { return strings.Join(*r, ",") }
func (r *resources) Set(v string) error { *r = append(*r, v); return nil }

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	resource string
	devices  []*pluginapi.Device
	socket   string
	server   *grpc.Server
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done() // the set never changes: hold the stream open until kubelet closes it
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	env := "FAKE_" + strings.ToUpper(strings.NewReplacer(".", "_", "/", "_", "-", "_").Replace(p.resource))
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{env: strings.Join(c.DevicesIds, ",")},
		})
	}
	return out, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func (p *plugin) serve() error {
	_ = os.Remove(p.socket)
	l, err := net.Listen("unix", p.socket)
	if err != nil {
		return err
	}
	p.server = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.server, p)
	go func() { _ = p.server.Serve(l) }()
	return nil
}

func register(kubeletSocket string, p *plugin) error {
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(p.socket),
		ResourceName: p.resource,
	})
	return err
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "kubelet's device-plugin directory")
	var res resources
	flag.Var(&res, "resource", "name=count (repeatable)")
	flag.Parse()
	if len(res) == 0 {
		log.Fatal("at least one --resource name=count is needed")
	}
	var plugins []*plugin
	for _, r := range res {
		name, countStr, ok := strings.Cut(r, "=")
		count, err := strconv.Atoi(countStr)
		if !ok || err != nil || count < 0 {
			log.Fatalf("--resource %q: want name=count", r)
		}
		p := &plugin{resource: name, socket: filepath.Join(*dir, "fake-"+strings.NewReplacer("/", "_").Replace(name)+".sock")}
		for i := 0; i < count; i++ {
			p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("fake-%d", i), Health: pluginapi.Healthy})
		}
		if err := p.serve(); err != nil {
			log.Fatalf("%s: listen on %s: %v", name, p.socket, err)
		}
		plugins = append(plugins, p)
	}
	kubeletSocket := filepath.Join(*dir, "kubelet.sock")
	registered := map[string]time.Time{}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		// (Re-)register whenever kubelet's socket is new: a restarted kubelet forgets its plugins.
		if st, err := os.Stat(kubeletSocket); err == nil {
			for _, p := range plugins {
				if registered[p.resource].Equal(st.ModTime()) {
					continue
				}
				if err := register(kubeletSocket, p); err != nil {
					log.Printf("%s: register: %v (retrying)", p.resource, err)
					continue
				}
				registered[p.resource] = st.ModTime()
				log.Printf("%s: registered %d devices with kubelet", p.resource, len(p.devices))
			}
		}
		select {
		case <-stop:
			for _, p := range plugins {
				p.server.Stop()
				_ = os.Remove(p.socket)
			}
			return
		case <-tick.C:
		}
	}
}
