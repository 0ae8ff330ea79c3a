/* How long a cache line takes to go from one CPU to another and back: two
 * threads pinned to two CPUs pass an atomic int back and forth. On shared
 * VMs the host sometimes runs two vCPUs far apart (another core complex or
 * socket), and every cache line a lock-step batch moves between shmvec's
 * processes then costs several times as much: on the 2-vCPU VMs 75-130 ns
 * a round trip near, 365-405 ns far (docs/performance.md, "False sharing of
 * the flags").
 *
 *     cc -O2 -pthread -o cpu_pingpong bench/cpu_pingpong.c && ./cpu_pingpong [CPU_A CPU_B]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { ROUND_TRIPS = 200000 };
static _Atomic int ball __attribute__((aligned(64)));

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void* partner(void* cpu) {
  if (pin(*(int*)cpu) != 0) {  /* (an error number returned, not set in errno) */
    fprintf(stderr, "cannot run on CPU %d\n", *(int*)cpu);
    exit(1);
  }
  for (int i = 0; i < ROUND_TRIPS; i++) {
    while (atomic_load_explicit(&ball, memory_order_acquire) != 1) {
    }
    atomic_store_explicit(&ball, 0, memory_order_release);
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 1 && argc != 3) {
    fprintf(stderr, "usage: %s [CPU_A CPU_B]\n", argv[0]);
    return 2;
  }
  int a = argc > 2 ? atoi(argv[1]) : 0, b = argc > 2 ? atoi(argv[2]) : 1;
  if (pin(a) != 0) {
    fprintf(stderr, "cannot run on CPU %d\n", a);
    return 1;
  }
  pthread_t thread;
  pthread_create(&thread, NULL, partner, &b);
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int i = 0; i < ROUND_TRIPS; i++) {
    atomic_store_explicit(&ball, 1, memory_order_release);
    while (atomic_load_explicit(&ball, memory_order_acquire) != 0) {
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  pthread_join(thread, NULL);
  double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
  printf("CPUs %d and %d: round trip %.0f ns\n", a, b, ns / ROUND_TRIPS);
  return 0;
}
