/* doeks' stand-in for nccl-tests' all_reduce_perf on doeks' own cluster (no GPU, no NCCL, no EFA there):
 * MPI_Allreduce of floats on the CPU, one rank per process, timed and checked as all_reduce_perf does it and
 * printed in its output format (nccl-tests 2.13, with the root column), so `invoke efa.report` (doeks.nccl)
 * parses it. Its first line says what it is: the transport is Open MPI's, not NCCL's.
 *
 * Accepts all_reduce_perf's options: -b minbytes -e maxbytes -f stepfactor -n iters -w warmup_iters -c check;
 * -g (GPUs per thread) is accepted and ignored. Sizes take K, M, G suffixes.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t parse_size(const char *text) {
    char *end = NULL;
    double value = strtod(text, &end);
    switch (end && *end ? *end : ' ') {
        case 'K': case 'k': value *= 1024.0; break;
        case 'M': case 'm': value *= 1024.0 * 1024.0; break;
        case 'G': case 'g': value *= 1024.0 * 1024.0 * 1024.0; break;
        default: break;
    }
    return (size_t)value;
}

/* one timed allreduce of `count` floats: seconds per iteration (the slowest rank's), and the wrong elements */
static double run(float *send, float *recv, size_t count, int in_place, int warmup, int iters, int nranks, int rank,
                  long *wrong) {
    const float expected = (float)nranks * (float)(nranks + 1) / 2.0f;  /* rank r sends r+1 everywhere */
    float *buffer = in_place ? send : recv;
    for (int i = 0; i < warmup; i++) {
        if (in_place) for (size_t j = 0; j < count; j++) send[j] = (float)(rank + 1);
        MPI_Allreduce(in_place ? MPI_IN_PLACE : send, buffer, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    /* timed: the refill of an in-place buffer is outside the clock */
    double total = 0.0;
    for (int i = 0; i < iters; i++) {
        if (in_place) for (size_t j = 0; j < count; j++) send[j] = (float)(rank + 1);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        MPI_Allreduce(in_place ? MPI_IN_PLACE : send, buffer, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        total += MPI_Wtime() - start;
    }
    double seconds = total / (iters > 0 ? iters : 1), slowest = 0.0;
    MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    long local = 0;
    for (size_t j = 0; j < count; j++) local += buffer[j] != expected;
    MPI_Allreduce(&local, wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return slowest;
}

int main(int argc, char **argv) {
    size_t minbytes = 8, maxbytes = 32 * 1024 * 1024;
    int factor = 2, iters = 20, warmup = 5, check = 1, gpus = 1, opt;
    while ((opt = getopt(argc, argv, "b:e:f:n:w:c:g:d:o:t:a:z:G:")) != -1) {
        switch (opt) {
            case 'b': minbytes = parse_size(optarg); break;
            case 'e': maxbytes = parse_size(optarg); break;
            case 'f': factor = atoi(optarg); break;
            case 'n': iters = atoi(optarg); break;
            case 'w': warmup = atoi(optarg); break;
            case 'c': check = atoi(optarg); break;
            case 'g': gpus = atoi(optarg); break;
            default: break;  /* nccl-tests options that mean nothing here */
        }
    }
    if (factor < 2) factor = 2;
    MPI_Init(&argc, &argv);
    int rank, nranks, namelen;
    char host[MPI_MAX_PROCESSOR_NAME];
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    MPI_Get_processor_name(host, &namelen);
    char library[MPI_MAX_LIBRARY_VERSION_STRING];
    int liblen;
    MPI_Get_library_version(library, &liblen);
    library[strcspn(library, ",\n")] = 0;  /* "Open MPI v4.1.4" */

    /* rank 0 prints every rank's host, in rank order (one process's stdout keeps the order) */
    char *hosts = rank == 0 ? malloc((size_t)nranks * MPI_MAX_PROCESSOR_NAME) : NULL;
    int *pids = rank == 0 ? malloc((size_t)nranks * sizeof(int)) : NULL, pid = (int)getpid();
    MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0, MPI_COMM_WORLD);
    MPI_Gather(&pid, 1, MPI_INT, pids, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("# doeks all_reduce_perf stand-in: %d ranks, MPI_Allreduce of floats on CPU (%s), transport: mpi/tcp "
               "(Open MPI's TCP BTL between pods; no GPU, no NCCL, no EFA)\n", nranks, library);
        printf("# nThread 1 nGpus %d minBytes %zu maxBytes %zu step: %d(factor) warmup iters: %d iters: %d agg iters: 1 "
               "validation: %d graph: 0\n#\n# Using devices\n", gpus, minbytes, maxbytes, factor, warmup, iters, check);
        for (int r = 0; r < nranks; r++)
            printf("#  Rank %2d Group  0 Pid %6d on %10s device  0 [cpu] CPU\n", r, pids[r],
                   hosts + (size_t)r * MPI_MAX_PROCESSOR_NAME);
        free(hosts);
        free(pids);
    }
    if (rank == 0) {
        printf("#\n#                                                              out-of-place                       in-place          \n");
        printf("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
        printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n");
        fflush(stdout);
    }
    size_t maxcount = maxbytes / sizeof(float) + 1;
    float *send = malloc(maxcount * sizeof(float)), *recv = malloc(maxcount * sizeof(float));
    if (!send || !recv) {
        fprintf(stderr, "all_reduce_perf: cannot allocate %zu bytes\n", 2 * maxcount * sizeof(float));
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const double bus = 2.0 * (nranks - 1) / nranks;
    double busbw_sum = 0.0;
    int rows = 0;
    long wrong_total = 0;
    for (size_t size = minbytes; size <= maxbytes; size *= (size_t)factor) {
        size_t count = size / sizeof(float);
        if (count == 0) count = 1;
        size_t bytes = count * sizeof(float);
        for (size_t j = 0; j < count; j++) send[j] = (float)(rank + 1);
        long wrong_oop = 0, wrong_ip = 0;
        double oop = run(send, recv, count, 0, warmup, iters, nranks, rank, &wrong_oop);
        double ip = run(send, recv, count, 1, warmup, iters, nranks, rank, &wrong_ip);
        double oop_algbw = bytes / oop / 1e9, ip_algbw = bytes / ip / 1e9;
        if (rank == 0) {
            char w1[16] = "N/A", w2[16] = "N/A";
            if (check) { snprintf(w1, sizeof w1, "%ld", wrong_oop); snprintf(w2, sizeof w2, "%ld", wrong_ip); }
            printf("%12zu  %12zu     float     sum      -1  %7.2f  %6.2f  %6.2f  %5s  %7.2f  %6.2f  %6.2f  %5s\n", bytes,
                   count, oop * 1e6, oop_algbw, oop_algbw * bus, w1, ip * 1e6, ip_algbw, ip_algbw * bus, w2);
            fflush(stdout);
        }
        busbw_sum += oop_algbw * bus;
        rows++;
        wrong_total += check ? wrong_oop + wrong_ip : 0;
    }
    if (rank == 0) {
        printf("# Out of bounds values : %ld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
        printf("# Avg bus bandwidth    : %g \n#\n", rows ? busbw_sum / rows : 0.0);
        fflush(stdout);
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}
