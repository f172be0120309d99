/* doeks' pause process for the local cluster's pod sandboxes: holds the pod's namespaces, reaps orphans, and exits
 * on SIGINT/SIGTERM. Built static here and imported as the pause image the kubelet and containerd name. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction act = {0};
    act.sa_handler = stop;
    sigaction(SIGINT, &act, NULL);
    sigaction(SIGTERM, &act, NULL);
    act.sa_handler = reap;
    act.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &act, NULL);
    for (;;)
        pause();
    return 42;
}
