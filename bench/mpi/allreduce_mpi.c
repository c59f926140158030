// The peer meshrun's all-reduce is compared with: MPI_Allreduce of f32 sums, timed as
// `meshrun bench allreduce` times a psum (p50 over iterations, busbw = algbw x 2(n-1)/n, as in
// ../shared/REFERENCE.md). Built and run by bench/mpi/compare.sh, not by CMake: Open MPI is not a
// dependency of meshrun.
//
// Usage: mpirun -n N allreduce_mpi SIZE_BYTES...
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int CompareDoubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (rank == 0) {
    printf("%8s %10s %8s %12s %12s %12s\n", "ranks", "bytes", "iters", "p50 time(us)",
           "algbw(GB/s)", "busbw(GB/s)");
  }
  for (int a = 1; a < argc; ++a) {
    const long bytes = atol(argv[a]);
    const long count = bytes / 4;
    long iters = (256L << 20) / (bytes > 0 ? bytes : 1);
    if (iters < 5) iters = 5;
    if (iters > 200) iters = 200;
    float* in = malloc(count * 4 + 4);
    float* out = malloc(count * 4 + 4);
    for (long i = 0; i < count; ++i) in[i] = (float)(rank + i % 7);
    double* times = malloc(sizeof(double) * iters);
    MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);  // warm-up
    for (long it = 0; it < iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double dt = MPI_Wtime() - t0, slowest = 0;
      MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      times[it] = slowest;
    }
    qsort(times, iters, sizeof(double), CompareDoubles);
    const double p50 = times[iters / 2];
    if (rank == 0) {
      const double algbw = bytes / p50 / 1e9;
      printf("%8d %10ld %8ld %12.1f %12.3f %12.3f\n", n, bytes, iters, p50 * 1e6, algbw,
             algbw * 2.0 * (n - 1) / n);
      fflush(stdout);
    }
    free(in);
    free(out);
    free(times);
  }
  MPI_Finalize();
  return 0;
}
