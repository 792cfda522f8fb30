// SPDX-License-Identifier: GPL-2.0
/*
 * reflow worker isolation: programs attached to one worker's cgroup (v2).
 *
 * ingress (cgroup_skb/ingress): packets of established flows pass. A new TCP
 * connection (SYN without ACK) to a guarded port (the worker's gRPC port) is
 * admitted when its source address is in an allow-list, or, on this host,
 * when the connecting socket belongs to an allowed cgroup (the gateway's):
 * the peer socket is found with bpf_sk_lookup_tcp and its cgroup read with
 * bpf_sk_cgroup_id. Everything else is dropped and counted.
 *
 * connect4 / connect6 (cgroup/connect4, cgroup/connect6): the worker may
 * connect only to allow-listed destinations (address prefix, and port or any
 * port); others fail at once with EPERM and are counted.
 *
 * Counters are per-CPU, summed by the loader (workers/ebpf.py).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

enum counter {
	INGRESS_ADMITTED = 0, /* new connections let in */
	INGRESS_DROPPED = 1,  /* new connections dropped */
	EGRESS_ALLOWED = 2,   /* connects let through */
	EGRESS_DENIED = 3,    /* connects refused with EPERM */
	COUNTERS = 4,
};

struct source_v4 { __u32 prefixlen; __u8 addr[4]; };
struct source_v6 { __u32 prefixlen; __u8 addr[16]; };
/* destination keys: the port (network order, 0 = any) comes first, so an
 * entry's prefix length is 16 + the address prefix length */
struct dest_v4 { __u32 prefixlen; __u16 port; __u8 addr[4]; } __attribute__((packed));
struct dest_v6 { __u32 prefixlen; __u16 port; __u8 addr[16]; } __attribute__((packed));

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u64);  /* cgroup id */
	__type(value, __u8);
} allowed_cgroups SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, __u16);  /* host order */
	__type(value, __u8);
} guarded_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct source_v4);
	__type(value, __u8);
} sources_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct source_v6);
	__type(value, __u8);
} sources_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct dest_v4);
	__type(value, __u8);
} destinations_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct dest_v6);
	__type(value, __u8);
} destinations_v6 SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *value = bpf_map_lookup_elem(&counters, &which);

	if (value)
		*value += 1; /* per-CPU: no other writer */
}

/* 1 when the socket that sent this SYN (found by the reversed tuple) lives in
 * an allowed cgroup */
static __always_inline int peer_allowed(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 size)
{
	struct bpf_sock *peer = bpf_sk_lookup_tcp(skb, tuple, size, BPF_F_CURRENT_NETNS, 0);
	__u64 cgroup;

	if (!peer)
		return 0;
	cgroup = bpf_sk_cgroup_id(peer);
	bpf_sk_release(peer);
	return bpf_map_lookup_elem(&allowed_cgroups, &cgroup) != 0;
}

static __always_inline int is_new_connection(__u8 flags)
{
	return (flags & 0x02) && !(flags & 0x10); /* SYN without ACK */
}

static __always_inline int guarded(__u16 port)
{
	return bpf_map_lookup_elem(&guarded_ports, &port) != 0;
}

static __always_inline int verdict(int allowed)
{
	count(allowed ? INGRESS_ADMITTED : INGRESS_DROPPED);
	return allowed;
}

SEC("cgroup_skb/ingress")
int reflow_ingress(struct __sk_buff *skb)
{
	struct bpf_sock_tuple tuple = {};
	struct tcphdr tcp;
	__u8 flags;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		struct source_v4 source = {.prefixlen = 32};

		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) || ip.protocol != IPPROTO_TCP)
			return 1;
		if (bpf_skb_load_bytes(skb, ip.ihl * 4, &tcp, sizeof(tcp)))
			return 1;
		flags = ((__u8 *)&tcp)[13];
		if (!is_new_connection(flags) || !guarded(bpf_ntohs(tcp.dest)))
			return 1;
		__builtin_memcpy(source.addr, &ip.saddr, 4);
		if (bpf_map_lookup_elem(&sources_v4, &source))
			return verdict(1);
		tuple.ipv4.saddr = ip.daddr; /* the peer's view: it sent from saddr to daddr */
		tuple.ipv4.daddr = ip.saddr;
		tuple.ipv4.sport = tcp.dest;
		tuple.ipv4.dport = tcp.source;
		return verdict(peer_allowed(skb, &tuple, sizeof(tuple.ipv4)));
	}
	if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		struct source_v6 source = {.prefixlen = 128};

		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) || ip6.nexthdr != IPPROTO_TCP)
			return 1; /* extension headers are not parsed: no new TCP connection is recognised behind them */
		if (bpf_skb_load_bytes(skb, sizeof(ip6), &tcp, sizeof(tcp)))
			return 1;
		flags = ((__u8 *)&tcp)[13];
		if (!is_new_connection(flags) || !guarded(bpf_ntohs(tcp.dest)))
			return 1;
		__builtin_memcpy(source.addr, &ip6.saddr, 16);
		if (bpf_map_lookup_elem(&sources_v6, &source))
			return verdict(1);
		__builtin_memcpy(tuple.ipv6.saddr, &ip6.daddr, 16);
		__builtin_memcpy(tuple.ipv6.daddr, &ip6.saddr, 16);
		tuple.ipv6.sport = tcp.dest;
		tuple.ipv6.dport = tcp.source;
		return verdict(peer_allowed(skb, &tuple, sizeof(tuple.ipv6)));
	}
	return 1;
}

static __always_inline int egress_verdict(int allowed)
{
	count(allowed ? EGRESS_ALLOWED : EGRESS_DENIED);
	return allowed; /* 0: connect() fails with EPERM */
}

SEC("cgroup/connect4")
int reflow_connect4(struct bpf_sock_addr *ctx)
{
	struct dest_v4 key = {.prefixlen = 16 + 32};
	__u32 ip = ctx->user_ip4;

	key.port = (__u16)ctx->user_port;
	__builtin_memcpy(key.addr, &ip, 4);
	if (bpf_map_lookup_elem(&destinations_v4, &key))
		return egress_verdict(1);
	key.port = 0;
	return egress_verdict(bpf_map_lookup_elem(&destinations_v4, &key) != 0);
}

SEC("cgroup/connect6")
int reflow_connect6(struct bpf_sock_addr *ctx)
{
	struct dest_v6 key = {.prefixlen = 16 + 128};
	__u32 ip[4];

	ip[0] = ctx->user_ip6[0];
	ip[1] = ctx->user_ip6[1];
	ip[2] = ctx->user_ip6[2];
	ip[3] = ctx->user_ip6[3];
	key.port = (__u16)ctx->user_port;
	__builtin_memcpy(key.addr, ip, 16);
	if (bpf_map_lookup_elem(&destinations_v6, &key))
		return egress_verdict(1);
	key.port = 0;
	return egress_verdict(bpf_map_lookup_elem(&destinations_v6, &key) != 0);
}
