// doeks' node binary: one executable for the Kubernetes components doeks' local cluster runs,
// chosen by the first argument (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy).
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	commands := map[string]func() *cobra.Command{
		"kube-apiserver":          apiserver.NewAPIServerCommand,
		"kube-controller-manager": controllermanager.NewControllerManagerCommand,
		"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
		"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
		"kube-proxy":              proxy.NewProxyCommand,
	}
	if len(os.Args) < 2 || commands[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: doeks-node kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy [flags]")
		os.Exit(2)
	}
	command := commands[os.Args[1]]()
	os.Args = append([]string{os.Args[1]}, os.Args[2:]...)
	os.Exit(cli.Run(command))
}
