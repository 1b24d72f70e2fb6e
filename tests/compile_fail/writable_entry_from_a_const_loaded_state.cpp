// rejects: conversion function from 'const SharedBuffer' to 'TensorRef' invokes a deleted function
// A const loaded state lends its tensors only for reading: an entry made from one would let a load
// write into memory its owner promised not to change.
import shardckpt;
using namespace shardckpt;

void f(const LoadedState& loaded, ShardedParam& p) { p.shard = loaded.tensor("k"); }
