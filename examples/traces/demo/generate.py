"""Generates the bundled demo trace (synthetic; same CSV format as the Alibaba openb trace).

Run from this folder: python3 generate.py. The output is committed; this script documents how.
"""
import csv
import random

rng = random.Random(7)
nodes = []
for i in range(24):
    nodes.append((f"demo-node-{i:03d}", 96000, 786432, 8, "G2"))
for i in range(24, 40):
    nodes.append((f"demo-node-{i:03d}", 64000, 262144, 2, "T4"))
for i in range(40, 48):
    nodes.append((f"demo-node-{i:03d}", 96000, 524288, 4, "V100M32"))
with open("openb_node_list_gpu_node.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
    w.writerows(nodes)

shapes = [  # (weight, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec)
    (30, 4000, 16384, 1, 1000, ""),
    (18, 3000, 8192, 1, 500, ""),
    (12, 2000, 8192, 1, 250, ""),
    (10, 6000, 16384, 1, 800, ""),
    (8, 8000, 32768, 0, 0, ""),
    (6, 2000, 4096, 1, 300, "T4"),
    (5, 16000, 65536, 2, 1000, ""),
    (4, 32000, 131072, 4, 1000, ""),
    (3, 64000, 262144, 8, 1000, "G2"),
    (4, 12000, 32768, 1, 1000, "V100M32"),
]
weights = [s[0] for s in shapes]
with open("openb_pod_list_default.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                "creation_time", "deletion_time", "scheduled_time"])
    for i in range(420):
        _, cpu, mem, num, milli, spec = rng.choices(shapes, weights)[0]
        w.writerow([f"demo-pod-{i:04d}", cpu, mem, num, milli, spec, "LS", "Running", 0, 0, 0])
