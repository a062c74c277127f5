"""Topology: which ranks share a host, which rail each rank uses, which hosts share a
switch; discovered per rank, completed by a topology file, gathered at rendezvous."""

from .file import TopoFile, TopologyFileError
from .file import load as load_file
from .model import Host, Interface, LinkClass, Rail, RankInfo, Topology, build, synthetic
from .order import host_order, ring_order

__all__ = ["Host", "Interface", "LinkClass", "Rail", "RankInfo", "TopoFile", "Topology",
           "TopologyFileError", "build", "host_order", "load_file", "ring_order", "synthetic"]
