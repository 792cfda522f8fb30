// SPDX-License-Identifier: GPL-2.0
/*
 * reflow worker isolation: programs attached to one worker's cgroup (v2).
 *
 * ingress (cgroup_skb/ingress): packets of established flows pass. A new TCP
 * connection (SYN without ACK) to any port but the open ones (the metrics
 * port) is checked, so a port is guarded from the moment it listens. When the
 * connecting socket is on this host (bpf_sk_lookup_tcp finds it, connecting),
 * it is admitted only if it belongs to an allowed cgroup (the gateway's, read
 * with bpf_sk_cgroup_id); a connection from another host is admitted when its
 * source address is in an allow-list. Everything else is dropped and counted.
 *
 * connect4 / connect6 / sendmsg4 / sendmsg6 (cgroup/...): the worker may
 * connect, or send unconnected UDP, only to allow-listed destinations
 * (address prefix, and port or any port; IPv4-mapped IPv6 addresses are
 * checked against the IPv4 list); others fail at once with EPERM and are
 * counted.
 *
 * IPv6 extension headers are walked (up to 6); a chain longer than that is
 * dropped when it may hide TCP, so nothing gets in unchecked.
 *
 * Counters are per-CPU, summed by the loader (workers/isolation/ebpf.py).
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
} open_ports SEC(".maps");

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

#define REMOTE (-1)

/* For a SYN from this host: 1 when the socket that sent it (found by the
 * reversed tuple, and connecting: a listener that happens to match the tuple
 * is not the sender) lives in an allowed cgroup, else 0. REMOTE when no local
 * socket sent it. */
static __always_inline int local_peer_allowed(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 size)
{
	struct bpf_sock *peer = bpf_sk_lookup_tcp(skb, tuple, size, BPF_F_CURRENT_NETNS, 0);
	__u64 cgroup;
	__u32 state;

	if (!peer)
		return REMOTE;
	state = peer->state;
	cgroup = bpf_sk_cgroup_id(peer);
	bpf_sk_release(peer);
	if (state != BPF_TCP_SYN_SENT)
		return REMOTE;
	return bpf_map_lookup_elem(&allowed_cgroups, &cgroup) != 0;
}

static __always_inline int is_new_connection(__u8 flags)
{
	return (flags & 0x02) && !(flags & 0x10); /* SYN without ACK */
}

static __always_inline int guarded(__u16 port)
{
	return bpf_map_lookup_elem(&open_ports, &port) == 0;
}

static __always_inline int verdict(int allowed)
{
	count(allowed ? INGRESS_ADMITTED : INGRESS_DROPPED);
	return allowed;
}

#define NOT_TCP (-1)
#define UNPARSED (-2)
#define MAX_EXTENSION_HEADERS 6

/* Where the TCP header starts behind the IPv6 header and its extension headers; NOT_TCP for
 * another transport (ICMPv6, UDP: they pass), UNPARSED when the chain is longer than we walk.
 * Fragments are reassembled before a socket's filter runs, so none are seen here. */
static __always_inline int tcp_offset_v6(struct __sk_buff *skb, __u8 next)
{
	int offset = sizeof(struct ipv6hdr);
	__u8 header[2];

#pragma unroll
	for (int i = 0; i < MAX_EXTENSION_HEADERS; i++) {
		if (next == IPPROTO_TCP)
			return offset;
		if (next != IPPROTO_HOPOPTS && next != IPPROTO_ROUTING && next != IPPROTO_DSTOPTS &&
		    next != IPPROTO_AH && next != IPPROTO_FRAGMENT)
			return NOT_TCP;
		if (bpf_skb_load_bytes(skb, offset, header, sizeof(header)))
			return UNPARSED;
		if (next == IPPROTO_FRAGMENT)
			offset += 8;
		else if (next == IPPROTO_AH)
			offset += (header[1] + 2) * 4;
		else
			offset += (header[1] + 1) * 8;
		next = header[0];
	}
	return next == IPPROTO_TCP ? offset : UNPARSED;
}

SEC("cgroup_skb/ingress")
int reflow_ingress(struct __sk_buff *skb)
{
	struct bpf_sock_tuple tuple = {};
	struct tcphdr tcp;
	__u8 flags;
	int local;

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
		tuple.ipv4.saddr = ip.daddr; /* the peer's view: it sent from saddr to daddr */
		tuple.ipv4.daddr = ip.saddr;
		tuple.ipv4.sport = tcp.dest;
		tuple.ipv4.dport = tcp.source;
		local = local_peer_allowed(skb, &tuple, sizeof(tuple.ipv4));
		if (local != REMOTE)
			return verdict(local); /* on this host the cgroup decides, whatever the address */
		__builtin_memcpy(source.addr, &ip.saddr, 4);
		return verdict(bpf_map_lookup_elem(&sources_v4, &source) != 0);
	}
	if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		struct source_v6 source = {.prefixlen = 128};
		int offset;

		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
			return 1;
		offset = tcp_offset_v6(skb, ip6.nexthdr);
		if (offset == NOT_TCP)
			return 1;
		if (offset < 0 || bpf_skb_load_bytes(skb, offset, &tcp, sizeof(tcp)))
			return verdict(0); /* TCP hidden behind headers we cannot walk: fail closed */
		flags = ((__u8 *)&tcp)[13];
		if (!is_new_connection(flags) || !guarded(bpf_ntohs(tcp.dest)))
			return 1;
		__builtin_memcpy(tuple.ipv6.saddr, &ip6.daddr, 16);
		__builtin_memcpy(tuple.ipv6.daddr, &ip6.saddr, 16);
		tuple.ipv6.sport = tcp.dest;
		tuple.ipv6.dport = tcp.source;
		local = local_peer_allowed(skb, &tuple, sizeof(tuple.ipv6));
		if (local != REMOTE)
			return verdict(local);
		__builtin_memcpy(source.addr, &ip6.saddr, 16);
		return verdict(bpf_map_lookup_elem(&sources_v6, &source) != 0);
	}
	return 1;
}

static __always_inline int egress_verdict(int allowed)
{
	count(allowed ? EGRESS_ALLOWED : EGRESS_DENIED);
	return allowed; /* 0: connect() fails with EPERM */
}

static __always_inline int destination_v4_allowed(__u32 ip, __u16 port)
{
	struct dest_v4 key = {.prefixlen = 16 + 32, .port = port};

	__builtin_memcpy(key.addr, &ip, 4);
	if (bpf_map_lookup_elem(&destinations_v4, &key))
		return 1;
	key.port = 0;
	return bpf_map_lookup_elem(&destinations_v4, &key) != 0;
}

static __always_inline int destination_v6_allowed(struct bpf_sock_addr *ctx)
{
	struct dest_v6 key = {.prefixlen = 16 + 128};
	__u16 port = (__u16)ctx->user_port;
	__u32 ip[4];

	ip[0] = ctx->user_ip6[0];
	ip[1] = ctx->user_ip6[1];
	ip[2] = ctx->user_ip6[2];
	ip[3] = ctx->user_ip6[3];
	if (ip[0] == 0 && ip[1] == 0 && ip[2] == bpf_htonl(0xffff)) /* ::ffff:a.b.c.d */
		return destination_v4_allowed(ip[3], port);
	key.port = port;
	__builtin_memcpy(key.addr, ip, 16);
	if (bpf_map_lookup_elem(&destinations_v6, &key))
		return 1;
	key.port = 0;
	return bpf_map_lookup_elem(&destinations_v6, &key) != 0;
}

SEC("cgroup/connect4")
int reflow_connect4(struct bpf_sock_addr *ctx)
{
	return egress_verdict(destination_v4_allowed(ctx->user_ip4, (__u16)ctx->user_port));
}

SEC("cgroup/connect6")
int reflow_connect6(struct bpf_sock_addr *ctx)
{
	return egress_verdict(destination_v6_allowed(ctx));
}

SEC("cgroup/sendmsg4")
int reflow_sendmsg4(struct bpf_sock_addr *ctx)
{
	return egress_verdict(destination_v4_allowed(ctx->user_ip4, (__u16)ctx->user_port));
}

SEC("cgroup/sendmsg6")
int reflow_sendmsg6(struct bpf_sock_addr *ctx)
{
	return egress_verdict(destination_v6_allowed(ctx));
}
